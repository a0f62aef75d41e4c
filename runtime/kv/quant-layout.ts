/**
 * The layout of a quant page: `pageTokens` positions of one sequence for every layer, each row (one token's K or V of
 * one layer, `width = kvHeads*headDim` values) in the format of runtime/kv/quant-format.ts (codes, then one
 * (lo, scale) f16 pair per group; K and V may have different formats). A stored row holds `positionsPerRow`
 * consecutive positions (more than one only where a group is wider than a row). Word layout:
 *
 *     [layer][kv: 0 = K, 1 = V][stored row in page: token / positionsPerRow][rowWords(layer, kv)]
 *
 * `pageWords = (pageTokens / positionsPerRow) * Σ_layers (keyRowWords + valueRowWords)`. Each layer's K and V rows have their own code
 * bits and clip quantile, in the K format's groups: a precision plan (runtime/kv/precision-plan.ts) chosen by the
 * calibration, or one format for every layer, with the layers listed in `boostLayers` at 4 bits unclipped (KITTY's
 * boosted precision at the grain of a layer, docs/kv-cache.md).
 */
import { InvalidRequestError } from '../../core/errors.ts';
import { assertPlan, type KvLayerPrecision, type KvPrecisionPlan } from './precision-plan.ts';
import {
  codeWordsPerRow,
  defaultGroupSize,
  positionsPerRow,
  type QuantRowFormat,
  rowWords,
  validateQuantRowFormat,
} from './quant-format.ts';

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
  /** Consecutive positions per stored row (every layer and side: they share the K format's groups). */
  positionsPerRow: number;
  /** Layers whose K and V use the boost format (ascending). */
  boostLayers: readonly number[];
  /** Per layer, the K and V code bits and clip quantiles the rows are stored with. */
  plan: KvPrecisionPlan;
  /** The rows of K (kv = 0) or V (kv = 1) of `layer`. */
  rows(layer: number, kv: 0 | 1): KvQuantRows;
  /** Word offset of K (kv = 0) or V (kv = 1) of `layer`, token 0 inside a quant page. */
  layerOffsetWords(layer: number, kv: 0 | 1): number;
}

function resolveFormat(
  heads: { kvHeads: number; headDim: number },
  o: KvRowFormatOptions | undefined,
  name: string,
): QuantRowFormat {
  const f: QuantRowFormat = {
    width: heads.kvHeads * heads.headDim,
    bits: o?.bits ?? 2,
    groupSize: o?.groupSize ?? defaultGroupSize(heads.kvHeads, heads.headDim),
    clipQuantile: o?.clipQuantile ?? 1,
  };
  const problem = validateQuantRowFormat(f);
  if (problem) throw new InvalidRequestError(`KV pool: ${name} format: ${problem}`, { option: name });
  return f;
}

/** The quant page layout of a pool's shape and formats (K and V default to 2 bits in groups of defaultGroupSize). */
export function quantPageLayout(shape: {
  layers: number;
  kvHeads: number;
  headDim: number;
  pageTokens: number;
  keyFormat?: KvRowFormatOptions;
  valueFormat?: KvRowFormatOptions;
  boostLayers?: readonly number[];
  /** Per layer K and V precision; replaces keyFormat/valueFormat's bits and clip (not with boostLayers). */
  plan?: KvPrecisionPlan;
}): KvQuantPageLayout {
  const { layers, pageTokens } = shape;
  const key = resolveFormat(shape, shape.keyFormat, 'keyFormat');
  const value = resolveFormat(shape, shape.valueFormat, 'valueFormat');
  const rowPositions = positionsPerRow(key);
  if (positionsPerRow(value) !== rowPositions) {
    throw new InvalidRequestError(
      `KV pool: K groups of ${key.groupSize} and V groups of ${value.groupSize} must span the same positions.`,
      { option: 'valueFormat' },
    );
  }
  if (pageTokens % rowPositions !== 0) {
    throw new InvalidRequestError(
      `KV pool: groups of ${key.groupSize} values span ${rowPositions} positions, which must divide the page's ${pageTokens}.`,
      { option: 'keyFormat' },
    );
  }
  const pageRows = pageTokens / rowPositions;
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
  if (shape.plan && boostLayers.length > 0) {
    throw new InvalidRequestError('A KV precision plan already says which layers are 4-bit; drop boostLayers.', {
      option: 'boostLayers',
    });
  }
  if (shape.plan) assertPlan(shape.plan, layers);
  const boosted: KvLayerPrecision = { key: { bits: 4, clipQuantile: 1 }, value: { bits: 4, clipQuantile: 1 } };
  const uniform: KvLayerPrecision = {
    key: { bits: key.bits, clipQuantile: key.clipQuantile },
    value: { bits: value.bits, clipQuantile: value.clipQuantile },
  };
  const plan: KvLayerPrecision[] =
    shape.plan?.map((l) => ({ key: { ...l.key }, value: { ...l.value } })) ??
    Array.from({ length: layers }, (_, l) => (boostLayers.includes(l) ? boosted : uniform));
  const rowsOf = (format: QuantRowFormat): KvQuantRows => ({
    format,
    rowWords: rowWords(format),
    codeWords: codeWordsPerRow(format),
  });
  // 1-bit codes (the weak control) have no plan entry: a uniform layer keeps the K and V formats as they are.
  const sideRows = (p: KvLayerPrecision['key'], base: QuantRowFormat, name: string) =>
    rowsOf(
      p.bits === base.bits && p.clipQuantile === base.clipQuantile
        ? base
        : resolveFormat(shape, { bits: p.bits, groupSize: key.groupSize, clipQuantile: p.clipQuantile }, name),
    );
  const layerRows = plan.map((p) => [sideRows(p.key, key, 'plan'), sideRows(p.value, value, 'plan')] as const);
  // Word offset of each layer's K rows in a page; V follows its layer's K.
  const layerStart: number[] = [];
  let pageWords = 0;
  for (const [k, v] of layerRows) {
    layerStart.push(pageWords);
    pageWords += pageRows * (k.rowWords + v.rowWords);
  }
  return {
    pageWords,
    key,
    value,
    positionsPerRow: rowPositions,
    boostLayers,
    plan,
    rows: (layer, kv) => layerRows[layer][kv],
    layerOffsetWords: (layer, kv) => layerStart[layer] + kv * pageRows * layerRows[layer][0].rowWords,
  };
}
