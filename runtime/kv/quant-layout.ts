/**
 * The layout of a quant page: `pageTokens` positions of one sequence for every layer, each row (one token's K or V of
 * one layer, `width = kvHeads*headDim` values) in the format of runtime/kv/quant-format.ts (codes, then one
 * (lo, scale) f16 pair per group; K and V may have different formats). Word layout:
 *
 *     [layer][kv: 0 = K, 1 = V][token in page][rowWords(layer, kv)]
 *
 * `pageWords = pageTokens * Σ_layers (keyRowWords + valueRowWords)`. Layers listed in `boostLayers` store K and V at
 * 4 bits, unclipped, in the K format's groups; the others use the K and V formats: KITTY's boosted precision at the
 * grain of a layer, for the few layers whose 2-bit cache costs the model most (docs/kv-cache.md).
 */
import { InvalidRequestError } from '../../core/errors.ts';
import { codeWordsPerRow, type QuantRowFormat, rowWords, validateQuantRowFormat } from './quant-format.ts';

/** A quantized row format without its width (the pool knows it: kvHeads × headDim). */
export type KvRowFormatOptions = Partial<Omit<QuantRowFormat, 'width'>>;

/** One layer's K or V rows inside a quant page. */
export interface KvQuantRows {
  format: QuantRowFormat;
  rowWords: number;
  codeWords: number;
}

/** What the demotion kernel and the mixed attention need to know about quant pages. */
export interface KvQuantPageLayout {
  pageWords: number;
  /** The K and V formats of the layers not boosted. */
  key: QuantRowFormat;
  value: QuantRowFormat;
  /** Layers whose K and V use the boost format (ascending). */
  boostLayers: readonly number[];
  /** The rows of K (kv = 0) or V (kv = 1) of `layer`. */
  rows(layer: number, kv: 0 | 1): KvQuantRows;
  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, token 0 inside a quant page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number;
}

function resolveFormat(width: number, o: KvRowFormatOptions | undefined, name: string): QuantRowFormat {
  const f: QuantRowFormat = {
    width,
    bits: o?.bits ?? 2,
    groupSize: o?.groupSize ?? Math.min(128, width),
    clipQuantile: o?.clipQuantile ?? 1,
  };
  const problem = validateQuantRowFormat(f);
  if (problem) throw new InvalidRequestError(`KV pool: ${name} format: ${problem}`, { option: name });
  return f;
}

/** The quant page layout of a pool's shape and formats (K and V default to 2 bits, groups of min(128, width)). */
export function quantPageLayout(shape: {
  layers: number;
  kvHeads: number;
  headDim: number;
  pageTokens: number;
  keyFormat?: KvRowFormatOptions;
  valueFormat?: KvRowFormatOptions;
  boostLayers?: readonly number[];
}): KvQuantPageLayout {
  const { layers, pageTokens } = shape;
  const width = shape.kvHeads * shape.headDim;
  const key = resolveFormat(width, shape.keyFormat, 'keyFormat');
  const value = resolveFormat(width, shape.valueFormat, 'valueFormat');
  const requested = Array.from(shape.boostLayers ?? []); // holes of a sparse array become undefined
  for (const layer of requested) {
    if (typeof layer !== 'number' || !Number.isInteger(layer) || layer < 0 || layer >= layers) {
      throw new InvalidRequestError(
        `boostLayers names ${String(layer)}, not a layer of this model (0..${layers - 1}).`,
        { option: 'boostLayers' },
      );
    }
  }
  const boostLayers = [...new Set(requested)].sort((a, b) => a - b);
  if (boostLayers.length < requested.length) {
    throw new InvalidRequestError(`boostLayers lists a layer twice: [${requested.join(', ')}].`, {
      option: 'boostLayers',
    });
  }
  const boost = resolveFormat(width, { bits: 4, groupSize: key.groupSize, clipQuantile: 1 }, 'boostLayers');
  const rowsOf = (format: QuantRowFormat): KvQuantRows => ({
    format,
    rowWords: rowWords(format),
    codeWords: codeWordsPerRow(format),
  });
  const plain: [KvQuantRows, KvQuantRows] = [rowsOf(key), rowsOf(value)];
  const boosted: [KvQuantRows, KvQuantRows] = [rowsOf(boost), rowsOf(boost)];
  const layerRows = Array.from({ length: layers }, (_, l) => (boostLayers.includes(l) ? boosted : plain));
  // Word offset of each layer's K rows in a page; V follows its layer's K.
  const layerStart: number[] = [];
  let pageWords = 0;
  for (const [k, v] of layerRows) {
    layerStart.push(pageWords);
    pageWords += pageTokens * (k.rowWords + v.rowWords);
  }
  return {
    pageWords,
    key,
    value,
    boostLayers,
    rows: (layer, kv) => layerRows[layer][kv],
    layerOffsetWords: (layer, kv) => layerStart[layer] + kv * pageTokens * layerRows[layer][0].rowWords,
  };
}
