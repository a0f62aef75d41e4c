/**
 * Clip quantiles stored with calibrated rotations (format version 2, GGUF metadata), read back by older-format
 * rules, and the clip fit itself on synthetic rows (CPU only).
 */
import { describe, expect, it } from 'vitest';
import { seededRandom } from '../../test/random.ts';
import type { ModelConfig } from '../model/config.ts';
import { CLIP_QUANTILE_GRID, fitClipQuantiles } from './clip-fit.ts';
import { identityMatrix } from './rotation.ts';
import {
  decodeRotations,
  encodeRotations,
  rotationMetadataEntries,
  rotationsFromMetadata,
  withStoredRotations,
} from './rotation-store.ts';

const config = { layers: 2, kvHeads: 2, headDim: 4 } as ModelConfig;
const n = 2 * 2 * 4 * 4;
const key = Float32Array.from({ length: n }, (_, i) => i / n);
const value = Float32Array.from({ length: n }, (_, i) => -i / n);

describe('clip quantiles at rest', () => {
  it('without clip quantiles the bytes are version 1, as before; with them version 2, both read back', () => {
    const v1 = encodeRotations({ key, value, tokens: 5 });
    expect(new DataView(v1.buffer).getUint32(4, true)).toBe(1);
    expect(v1.byteLength).toBe(16 + 8 * n);
    const old = decodeRotations(v1, config);
    expect(old.clip).toBeUndefined();
    expect(Array.from(old.key)).toEqual(Array.from(key));

    const v2 = encodeRotations({ key, value, tokens: 5, clip: { key: 0.96, value: 0.92 } });
    expect(new DataView(v2.buffer).getUint32(4, true)).toBe(2);
    const back = decodeRotations(v2, config);
    expect(back.clip!.key).toBeCloseTo(0.96, 6);
    expect(back.clip!.value).toBeCloseTo(0.92, 6);
    expect(Array.from(back.value)).toEqual(Array.from(value));
    expect(() =>
      decodeRotations(encodeRotations({ key, value, tokens: 5, clip: { key: 0.3, value: 1 } }), config),
    ).toThrow(/damaged/);
  });

  it('GGUF metadata carries them when present and stays readable without them', () => {
    const meta = (r: Parameters<typeof rotationMetadataEntries>[0]) =>
      Object.fromEntries(rotationMetadataEntries(r).map((e) => [e.key, e.value]));
    expect(rotationsFromMetadata(meta({ key, value, tokens: 3 }), config)!.clip).toBeUndefined();
    expect(
      rotationsFromMetadata(meta({ key, value, tokens: 3, clip: { key: 0.94, value: 0.9 } }), config)!.clip,
    ).toEqual({
      key: 0.94,
      value: 0.9,
    });
    const broken = { ...meta({ key, value, tokens: 3 }), 'longtab.kv.clip_key': 0.94 };
    expect(() => rotationsFromMetadata(broken, config)).toThrow(/clip quantiles/);
  });

  it('the pool quantizes with them in quant mode only', () => {
    const base = { layers: 2, kvHeads: 2, headDim: 4, budgetBytes: 1 << 20 };
    const r = { key, value, tokens: 3, clip: { key: 0.94, value: 0.9 } };
    const quant = withStoredRotations({ ...base, kv: 'quant', keyFormat: { bits: 2, groupSize: 8 } }, r);
    expect(quant.rotation).toEqual({ kind: 'calibrated', key, value });
    expect(quant.pool).toMatchObject({
      keyFormat: { bits: 2, groupSize: 8, clipQuantile: 0.94 },
      valueFormat: { clipQuantile: 0.9 },
    });
    expect(withStoredRotations({ ...base, kv: 'f16' }, r).pool.keyFormat).toBeUndefined();
    expect(withStoredRotations({ ...base, kv: 'quant' }, { key, value, tokens: 3 }).pool.keyFormat).toBeUndefined();
  });
});

describe('clip fit', () => {
  const shape = { layers: 2, kvHeads: 2, headDim: 16 };
  const d = shape.headDim;
  const width = shape.kvHeads * d;
  const matrices = shape.layers * shape.kvHeads;
  const identities = new Float32Array(matrices * d * d);
  for (let m = 0; m < matrices; m++) identities.set(identityMatrix(d), m * d * d);
  const format = { width, bits: 2 as const, groupSize: width };

  it('clips Gaussian rows (2-bit codes at min/max waste their range on the tails)', async () => {
    const random = seededRandom(7);
    const gauss = () => Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random());
    const tokens = 64;
    const rows = () => Array.from({ length: shape.layers }, () => Float32Array.from({ length: tokens * width }, gauss));
    const fit = await fitClipQuantiles(
      shape,
      { tokens, keys: rows(), values: rows() },
      { key: identities, value: identities, query: identities },
      format,
    );
    expect(fit.grid).toEqual(CLIP_QUANTILE_GRID);
    expect(fit.keyError[0]).toBeCloseTo(shape.layers, 9); // each layer relative to its own clip-1 error
    expect(fit.key).toBeLessThan(1);
    expect(fit.value).toBeLessThan(1);
    expect(Math.min(...fit.keyError)).toBeLessThan(0.9 * shape.layers);
  });

  it('keeps min/max when clipping cannot help (rows already on four levels)', async () => {
    const tokens = 8;
    const levels = () =>
      Array.from({ length: shape.layers }, () =>
        Float32Array.from({ length: tokens * width }, (_, i) => (i % 4) - 1.5),
      );
    const fit = await fitClipQuantiles(
      shape,
      { tokens, keys: levels(), values: levels() },
      { key: identities, value: identities, query: identities },
      format,
    );
    expect(fit).toMatchObject({ key: 1, value: 1 });
  });
});
