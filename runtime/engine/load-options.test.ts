/**
 * parseLoadOptions, the one check of load options (no GPU): every option's bad values, the experimental group, the
 * combinations, and the defaults it resolves (which build the same pool as before it existed); resolveKvMode, the
 * default KV mode once the model's shape is known.
 */
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import type { ModelConfig } from '../model/config.ts';
import type { EngineLoadOptions } from './api-types.ts';
import { defaultRotation, int2Unfit, type ParsedLoadOptions, parseLoadOptions, resolveKvMode } from './load-options.ts';
import { kvPoolOptions } from './model-runner.ts';

/** The error parseLoadOptions throws for `input` (it must throw an InvalidRequestError). */
function rejection(input: unknown): InvalidRequestError {
  try {
    parseLoadOptions(input);
  } catch (error) {
    expect(error).toBeInstanceOf(InvalidRequestError);
    return error as InvalidRequestError;
  }
  throw new Error(`parseLoadOptions accepted ${JSON.stringify(input)}`);
}

const DEFAULTS: ParsedLoadOptions = {
  kv: undefined,
  kvBudgetBytes: 64 * 1024 * 1024,
  hostKvBudgetBytes: 64 * 1024 * 1024,
  persist: false,
  maxSequences: 16,
  maxContextTokens: undefined,
  prefillChunk: undefined,
  rotation: undefined,
  calibrate: 'background',
  onProgress: undefined,
  headersTimeoutMs: 30_000,
  chunkTimeoutMs: 30_000,
  sink: 64,
  window: 256,
  groupSize: undefined,
  codeBits: 2,
  boostLayers: [],
  precisionPlan: 'calibrated',
  prefillMatmul: 'auto',
  prefillAttention: 'auto',
  calibrationTokens: undefined,
};

describe('parseLoadOptions', () => {
  it('resolves nothing passed to the defaults, kv and its rotation left to the model and ModelRunner.load', () => {
    expect(parseLoadOptions(undefined)).toEqual(DEFAULTS);
    expect(parseLoadOptions(null)).toEqual(DEFAULTS);
    expect(parseLoadOptions({})).toEqual(DEFAULTS);
    expect(parseLoadOptions({ experimental: {} })).toEqual(DEFAULTS);
    // An omitted rotation stays undefined: ModelRunner.load tells it from an explicit one (defaultRotation: int2
    // uses calibrated rotations where stored, Hadamard until then; f16 none).
    expect(parseLoadOptions({ kv: 'int2' })).toEqual({ ...DEFAULTS, kv: 'int2' });
    expect(parseLoadOptions({ kv: 'f16' })).toEqual({ ...DEFAULTS, kv: 'f16' });
    expect(defaultRotation('int2')).toBe('calibrated');
    expect(defaultRotation('f16')).toBe('none');
    expect(parseLoadOptions({ kv: 'int2', rotation: 'none' }).rotation).toBe('none');
    // A rotation passed without kv is kept; the mode is still the model's to decide.
    expect(parseLoadOptions({ rotation: 'calibrated' })).toEqual({ ...DEFAULTS, rotation: 'calibrated' });
  });

  it('keeps every value it accepts, the experimental ones included', () => {
    const onProgress = () => {};
    const input: EngineLoadOptions = {
      kv: 'int2',
      kvBudgetBytes: 1,
      hostKvBudgetBytes: 0,
      persist: true,
      maxSequences: 256,
      maxContextTokens: 1 << 24,
      prefillChunk: 4096,
      rotation: 'calibrated',
      calibrate: 'off',
      onProgress,
      network: { headersTimeoutMs: 1, chunkTimeoutMs: 3_600_000 },
      experimental: {
        sink: 0,
        window: 0,
        groupSize: 1 << 16,
        codeBits: 2,
        boostLayers: [5, 0],
        precisionPlan: 'uniform',
        prefillMatmul: 'int8-dot',
        prefillAttention: 'f32',
        calibrationTokens: 16,
      },
    };
    const { experimental, network, ...top } = input;
    const parsed = parseLoadOptions(input);
    expect(parsed).toEqual({ ...top, ...network, ...experimental });
    expect(parsed.onProgress).toBe(onProgress);
    // Its own copy of the layer list.
    expect(parsed.boostLayers).not.toBe(experimental?.boostLayers);
    expect(parseLoadOptions({ kv: 'int2', experimental: { codeBits: 1 } }).codeBits).toBe(1);
  });

  it('accepts any in-range integers (property)', () => {
    fc.assert(
      fc.property(
        fc.record({
          kvBudgetBytes: fc.integer({ min: 1, max: Number.MAX_SAFE_INTEGER }),
          maxSequences: fc.integer({ min: 1, max: 256 }),
          prefillChunk: fc.integer({ min: 1, max: 4096 }),
          sink: fc.nat(),
          window: fc.nat(),
          groupSize: fc.integer({ min: 1, max: 1 << 16 }),
          calibrationTokens: fc.integer({ min: 16, max: 4096 }),
        }),
        ({ kvBudgetBytes, maxSequences, prefillChunk, ...experimental }) => {
          const parsed = parseLoadOptions({ kvBudgetBytes, maxSequences, prefillChunk, experimental });
          expect(parsed).toMatchObject({ kvBudgetBytes, maxSequences, prefillChunk, ...experimental });
        },
      ),
    );
  });

  it.each<[string, EngineLoadOptions, RegExp]>([
    ['kv', { kv: 'int4' as 'int2' }, /^kv = "int4" is invalid: use 'f16' or 'int2'\.$/],
    ['kv', { kv: null as unknown as 'f16' }, /kv = null is invalid/],
    ['kvBudgetBytes', { kvBudgetBytes: 0 }, /^kvBudgetBytes = 0 is invalid: use an integer >= 1\.$/],
    ['kvBudgetBytes', { kvBudgetBytes: -1 }, /kvBudgetBytes = -1/],
    ['kvBudgetBytes', { kvBudgetBytes: 1.5 }, /kvBudgetBytes = 1.5/],
    ['kvBudgetBytes', { kvBudgetBytes: Number.NaN }, /kvBudgetBytes = NaN/],
    ['kvBudgetBytes', { kvBudgetBytes: 2 ** 60 }, /kvBudgetBytes/],
    ['kvBudgetBytes', { kvBudgetBytes: '4096' as unknown as number }, /kvBudgetBytes = "4096"/],
    ['hostKvBudgetBytes', { hostKvBudgetBytes: -1 }, /^hostKvBudgetBytes = -1 is invalid: use an integer >= 0\.$/],
    ['hostKvBudgetBytes', { hostKvBudgetBytes: 0.5 }, /hostKvBudgetBytes = 0.5/],
    ['persist', { persist: 'yes' as unknown as boolean }, /^persist = "yes" is invalid: use true or false\.$/],
    ['maxSequences', { maxSequences: 0 }, /maxSequences = 0 is invalid: use an integer in 1\.\.256/],
    ['maxSequences', { maxSequences: 257 }, /maxSequences = 257/],
    ['maxContextTokens', { maxContextTokens: 0 }, /maxContextTokens = 0 is invalid: use an integer >= 1/],
    ['prefillChunk', { prefillChunk: 0 }, /prefillChunk = 0 is invalid: use an integer in 1\.\.4096/],
    ['prefillChunk', { prefillChunk: 4097 }, /prefillChunk = 4097/],
    [
      'rotation',
      { rotation: 'diagonal' as 'none' },
      /rotation = "diagonal" is invalid: use 'hadamard', 'none' or 'calibrated'/,
    ],
    ['calibrate', { calibrate: 'now' as 'off' }, /calibrate = "now" is invalid: use 'background' or 'off'/],
    ['onProgress', { onProgress: 5 as unknown as () => void }, /onProgress = 5 is invalid: use a function/],
    ['network.headersTimeoutMs', { network: { headersTimeoutMs: 0 } }, /network\.headersTimeoutMs = 0 .*1\.\.3600000/],
    ['network.chunkTimeoutMs', { network: { chunkTimeoutMs: 3_600_001 } }, /network\.chunkTimeoutMs = 3600001/],
    ['timeoutMs', { network: { timeoutMs: 5 } as never }, /load options network: unknown field 'timeoutMs'/],
    ['experimental.sink', { experimental: { sink: -1 } }, /experimental\.sink = -1 is invalid: use an integer >= 0/],
    ['experimental.window', { experimental: { window: 0.5 } }, /experimental\.window = 0.5/],
    ['experimental.groupSize', { experimental: { groupSize: 0 } }, /experimental\.groupSize = 0 .*1\.\.65536/],
    ['experimental.groupSize', { experimental: { groupSize: 65537 } }, /experimental\.groupSize = 65537/],
    [
      'experimental.codeBits',
      { experimental: { codeBits: 3 as 2 } },
      /experimental\.codeBits = 3 is invalid: use 1 or 2/,
    ],
    ['experimental.boostLayers', { experimental: { boostLayers: '3' as unknown as number[] } }, /boostLayers = "3"/],
    ['experimental.boostLayers', { experimental: { boostLayers: [-1] } }, /boostLayers = \[-1\] .*integers >= 0/],
    ['experimental.boostLayers', { experimental: { boostLayers: [1.5] } }, /boostLayers = \[1.5\]/],
    // biome-ignore lint/suspicious/noSparseArray: a hole is what this case checks
    ['experimental.boostLayers', { experimental: { boostLayers: [1, , 2] as number[] } }, /boostLayers/],
    ['experimental.boostLayers', { kv: 'int2', experimental: { boostLayers: [3, 1, 3] } }, /layer 3 is listed twice/],
    [
      'experimental.prefillMatmul',
      { experimental: { prefillMatmul: 'int4' as 'f32' } },
      /experimental\.prefillMatmul = "int4" is invalid: use 'auto', 'f32' or 'int8-dot'/,
    ],
    [
      'experimental.prefillAttention',
      { experimental: { prefillAttention: 'int8' as 'f32' } },
      /experimental\.prefillAttention = "int8" is invalid: use 'auto', 'f32' or 'int8-dot'/,
    ],
    [
      'experimental.calibrationTokens',
      { experimental: { calibrationTokens: 15 } },
      /calibrationTokens = 15 .*16\.\.4096/,
    ],
    ['experimental.calibrationTokens', { experimental: { calibrationTokens: 4097 } }, /calibrationTokens = 4097/],
  ])('rejects a bad %s, naming it', (field, input, message) => {
    const error = rejection(input);
    expect(error.message).toMatch(message);
    expect(error.details.field).toBe(field);
  });

  it('boosted layers need kv int2 (or omitted: int2 where the model allows it) with 2-bit codes', () => {
    const ok = parseLoadOptions({ kv: 'int2', experimental: { boostLayers: [5] } });
    expect(ok.boostLayers).toEqual([5]);
    expect(parseLoadOptions({ experimental: { boostLayers: [5] } })).toMatchObject({ kv: undefined, boostLayers: [5] });
    for (const input of [
      { kv: 'f16', experimental: { boostLayers: [5] } },
      { kv: 'int2', experimental: { codeBits: 1, boostLayers: [5] } },
      { experimental: { codeBits: 1, boostLayers: [5] } },
    ] as const) {
      const error = rejection(input);
      expect(error.message).toMatch(/experimental\.boostLayers needs kv: 'int2' with 2-bit codes/);
      expect(error.details.field).toBe('experimental.boostLayers');
    }
    // No layers is no tier: any cache takes an empty list.
    expect(parseLoadOptions({ kv: 'f16', experimental: { boostLayers: [] } }).boostLayers).toEqual([]);
  });

  it('rejects unknown fields with the known ones, and says where a research knob belongs', () => {
    const unknown = rejection({ kv: 'f16', contextSize: 4096 });
    expect(unknown.message).toBe(
      "load options: unknown field 'contextSize'. Supported fields: kv, kvBudgetBytes, hostKvBudgetBytes, persist, maxSequences, maxContextTokens, prefillChunk, rotation, calibrate, onProgress, network, experimental.",
    );
    expect(unknown.details.field).toBe('contextSize');
    for (const knob of [
      'sink',
      'window',
      'groupSize',
      'codeBits',
      'boostLayers',
      'prefillMatmul',
      'calibrationTokens',
    ]) {
      expect(rejection({ [knob]: 1 }).message).toMatch(
        new RegExp(`unknown field '${knob}'\\. It is experimental: pass it as experimental: \\{ ${knob} \\}\\.`),
      );
    }
    expect(rejection({ experimental: { kv: 'int2' } }).message).toBe(
      "load options experimental: unknown field 'kv'. Supported fields: sink, window, groupSize, codeBits, boostLayers, precisionPlan, prefillMatmul, prefillAttention, calibrationTokens.",
    );
    // Internal options of ModelRunner.load are not the caller's to set.
    expect(rejection({ rotationCache: {} }).message).toMatch(/unknown field 'rotationCache'/);
    expect(rejection({ missingCalibration: 'hadamard' }).message).toMatch(/unknown field 'missingCalibration'/);
  });

  it('takes only plain objects', () => {
    for (const input of ['f16', 5, [], new Map(), new (class Options {})()]) {
      expect(rejection(input).message).toBe('load options must be a plain object.');
    }
    for (const experimental of [null, 'yes', [1]]) {
      expect(rejection({ experimental }).message).toBe('load options experimental must be a plain object.');
    }
    expect(parseLoadOptions(Object.assign(Object.create(null), { kv: 'int2' })).kv).toBe('int2');
  });
});

/**
 * Shapes of real models: stories260K (rows of 32), SmolLM2-360M (rows of 320: no groups of 128, one group of the
 * row), a head of 12; and rows of 120 (3 heads of 40), too few for groups of 128 and no multiple of 2-bit words.
 */
const STORIES = { kvHeads: 4, headDim: 8 };
const SMOLLM2 = { kvHeads: 5, headDim: 64 };
const HEAD12 = { kvHeads: 4, headDim: 12 };
const ROWS120 = { kvHeads: 3, headDim: 40 };

describe('resolveKvMode: an omitted kv is int2 where the model allows it, else f16', () => {
  it('takes int2 where the rows cut into quant groups and the Hadamard rotation fits the heads', () => {
    expect(int2Unfit({}, STORIES)).toBeNull();
    expect(resolveKvMode(parseLoadOptions({}), STORIES)).toBe('int2');
    expect(resolveKvMode(parseLoadOptions({}), { kvHeads: 8, headDim: 128 })).toBe('int2');
    expect(resolveKvMode(parseLoadOptions({}), { kvHeads: 2, headDim: 64 })).toBe('int2');
    // Rows of 5 heads of 64 take one group of 320 (defaultGroupSize), not the f16 cache.
    expect(int2Unfit({}, SMOLLM2)).toBeNull();
    expect(resolveKvMode(parseLoadOptions({}), SMOLLM2)).toBe('int2');
  });

  it('falls back to f16 where they do not, and says why', () => {
    expect(int2Unfit({}, ROWS120)).toMatch(/group size 120 must be a multiple of 16/);
    expect(resolveKvMode(parseLoadOptions({}), ROWS120)).toBe('f16');
    // A group size asked for that does not divide the row says so; one that does makes it fit.
    expect(int2Unfit({ groupSize: 128 }, SMOLLM2)).toMatch(/group size 128 must divide the row width 320/);
    expect(resolveKvMode(parseLoadOptions({ experimental: { groupSize: 128 } }), SMOLLM2)).toBe('f16');
    expect(resolveKvMode(parseLoadOptions({ experimental: { groupSize: 64 } }), SMOLLM2)).toBe('int2');
    // Rows of 48 form one group of 48, but Hadamard needs a power-of-two head; without a rotation int2 fits.
    expect(int2Unfit({}, HEAD12)).toMatch(/power-of-two head dimension, not 12/);
    expect(resolveKvMode(parseLoadOptions({}), HEAD12)).toBe('f16');
    expect(resolveKvMode(parseLoadOptions({ rotation: 'none' }), HEAD12)).toBe('int2');
    // 1-bit codes need groups of at least 32: rows of 16 have none.
    expect(resolveKvMode(parseLoadOptions({}), { kvHeads: 2, headDim: 8 })).toBe('int2');
    expect(resolveKvMode(parseLoadOptions({ experimental: { codeBits: 1 } }), { kvHeads: 2, headDim: 8 })).toBe('f16');
  });

  it('keeps an explicit kv either way (a model that cannot take int2 then fails in the pool, as before)', () => {
    expect(resolveKvMode(parseLoadOptions({ kv: 'f16' }), STORIES)).toBe('f16');
    expect(resolveKvMode(parseLoadOptions({ kv: 'int2' }), ROWS120)).toBe('int2');
  });

  it('fails boosted layers with an omitted kv on a model that cannot take int2, naming why', () => {
    const options = parseLoadOptions({ experimental: { boostLayers: [1] } });
    expect(resolveKvMode(options, STORIES)).toBe('int2');
    expect(() => resolveKvMode(options, ROWS120)).toThrow(InvalidRequestError);
    expect(() => resolveKvMode(options, ROWS120)).toThrow(
      /experimental\.boostLayers needs the 2-bit cache, and this model cannot take it \(.*group size 120/,
    );
  });
});

describe('kvPoolOptions of parsed options', () => {
  const config = { layers: 5, kvHeads: 4, headDim: 8, contextLength: 512 } as ModelConfig;
  const shape = {
    layers: 5,
    kvHeads: 4,
    headDim: 8,
    budgetBytes: 64 << 20,
    maxSequences: 16,
    maxSequenceTokens: 512,
  };
  const int2Pool = {
    ...shape,
    kv: 'quant',
    sink: 64,
    window: 256,
    keyFormat: { bits: 2, groupSize: undefined },
    valueFormat: { bits: 2, groupSize: undefined },
  };

  it("builds the pool the engine built before parseLoadOptions for each kv (f16; int2's sink 64, window 256)", () => {
    expect(kvPoolOptions(config, parseLoadOptions({ kv: 'f16' }))).toEqual(shape);
    expect(kvPoolOptions(config, parseLoadOptions({ kv: 'int2' }))).toEqual(int2Pool);
    // The same pool from a ModelRunner.load caller that passes only part of the options.
    expect(kvPoolOptions(config, { kv: 'int2' })).toEqual(kvPoolOptions(config, parseLoadOptions({ kv: 'int2' })));
  });

  it('builds from the defaults the int2 pool where the model allows it, else the f16 one', () => {
    expect(kvPoolOptions(config, parseLoadOptions({}))).toEqual(int2Pool);
    expect(kvPoolOptions(config, {})).toEqual(int2Pool);
    const rows120 = { ...config, ...ROWS120 } as ModelConfig;
    expect(kvPoolOptions(rows120, parseLoadOptions({}))).toEqual({ ...shape, ...ROWS120 });
  });

  it('maps the experimental knobs and the public sizes', () => {
    const pool = kvPoolOptions(
      config,
      parseLoadOptions({
        kv: 'int2',
        kvBudgetBytes: 1 << 20,
        maxSequences: 2,
        maxContextTokens: 128,
        rotation: 'none',
        experimental: { sink: 16, window: 32, groupSize: 32, codeBits: 2, boostLayers: [3] },
      }),
    );
    expect(pool).toMatchObject({
      budgetBytes: 1 << 20,
      maxSequences: 2,
      maxSequenceTokens: 128,
      sink: 16,
      window: 32,
      keyFormat: { bits: 2, groupSize: 32 },
      boostLayers: [3],
    });
    expect(kvPoolOptions(config, parseLoadOptions({ kv: 'int2', experimental: { codeBits: 1 } })).keyFormat).toEqual({
      bits: 1,
      groupSize: undefined,
    });
  });

  it('keeps the invariant that boosted layers are a tier of the 2-bit cache (for callers that skip the parser)', () => {
    expect(() => kvPoolOptions(config, { kv: 'f16', boostLayers: [1] })).toThrow(InvalidRequestError);
    expect(() => kvPoolOptions(config, { kv: 'int2', codeBits: 1, boostLayers: [1] })).toThrow(/2-bit codes/);
  });
});
