import { describe, expect, it } from 'vitest';
import { GgmlType } from '../core/gguf-types.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withFeatures, withLimits, withTestGpu } from '../test/gpu.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { defaultMatmulVariant, prepareMatmul } from './matmul.ts';
import {
  MATMUL_TILES,
  MATMUL_VARIANTS,
  type MatmulVariant,
  matmulTileShape,
  registerTiledMatmulWgsl,
} from './matmul.wgsl.ts';
import { dequantize, randomWeightBytes } from './reference/dequantize.ts';
import { matmulReference, maxErrorRelativeToMagnitude } from './reference/matmul.ts';
import { releaseWeight, uploadWeightFromBytes } from './weights.ts';

const ctx = withTestGpu();

/**
 * Tolerance: f32 accumulation (and f32 dequantization on both sides) errs by a few ulps of the sum of |w·x|, so we
 * allow 1e-4 of that L1 magnitude per output (plus 1e-6 absolute).
 */
const RTOL = 1e-4;

// K per type: not a multiple of the matvec threads (32-128) nor of the 32-wide tile where the block allows it.
const TYPES: [string, GgmlType, number][] = [
  ['F32', GgmlType.F32, 291],
  ['F16', GgmlType.F16, 291],
  ['BF16', GgmlType.BF16, 291],
  ['Q8_0', GgmlType.Q8_0, 288],
  ['Q4_0', GgmlType.Q4_0, 288],
  ['Q4_1', GgmlType.Q4_1, 288],
  ['Q5_0', GgmlType.Q5_0, 288],
  ['Q5_1', GgmlType.Q5_1, 288],
  ['Q4_K', GgmlType.Q4_K, 768],
  ['Q5_K', GgmlType.Q5_K, 768],
  ['Q6_K', GgmlType.Q6_K, 768],
  ['Q2_K', GgmlType.Q2_K, 768],
  ['Q3_K', GgmlType.Q3_K, 768],
  ['IQ4_NL', GgmlType.IQ4_NL, 288],
  ['IQ4_XS', GgmlType.IQ4_XS, 768],
];

interface Case {
  tokens: number;
  rows: number;
  bias: boolean;
  maxRowsPerPart?: number;
  /** The tiled kernel (tokens > 1); tokens = 1 always runs the matvec. */
  variant?: MatmulVariant;
  /** Test name only: 'matvec' or the variant. */
  kernel?: string;
  /** y starts with random values and the kernel adds to them. */
  accumulate?: boolean;
}

/** Each case once per tiled-matmul variant when it has tokens > 1 (once when it runs the matvec). */
function perVariant(cases: Case[]): Case[] {
  return cases.flatMap((c) =>
    c.tokens === 1
      ? [{ ...c, kernel: 'matvec' }]
      : MATMUL_VARIANTS.map((variant) => ({ ...c, variant, kernel: variant })),
  );
}

// N = 37 is neither a multiple of the 32-row tile nor of the 4 matvec rows per workgroup.
const CASES: Case[] = [
  { tokens: 1, rows: 37, bias: false },
  { tokens: 1, rows: 37, bias: true, maxRowsPerPart: 16 },
  { tokens: 2, rows: 37, bias: true },
  { tokens: 7, rows: 37, bias: false, maxRowsPerPart: 13 },
  { tokens: 33, rows: 37, bias: true },
  // Neither rows nor tokens a multiple of the 64- and 128-wide tiles; more than one tile each way; parts that split
  // a 64- and a 128-row tile.
  { tokens: 67, rows: 70, bias: true },
  { tokens: 130, rows: 131, bias: false, maxRowsPerPart: 100 },
];

async function runMatmul(
  gpu: GpuContext,
  type: GgmlType,
  K: number,
  c: Case,
  transformSource?: (code: string) => string,
) {
  const random = seededRandom(type * 7919 + K * 31 + c.tokens * 7 + c.rows + (c.bias ? 1 : 0));
  const N = c.rows;
  const raw = randomWeightBytes(type, K * N, random);
  const x = randomFloats(random, c.tokens * K, 1);
  const bias = c.bias ? randomFloats(random, N, 0.5) : undefined;
  const before = gpu.allocator.snapshot().totalBuffers;
  const weight = uploadWeightFromBytes(gpu, 'w', type, [K, N], raw, { maxRowsPerPart: c.maxRowsPerPart });
  if (c.maxRowsPerPart) expect(weight.parts.length).toBe(Math.ceil(N / c.maxRowsPerPart));
  const input = gpu.allocator.createStorage('x', 'scratch', x);
  const initial = c.accumulate ? randomFloats(random, c.tokens * N, 3) : new Float32Array(c.tokens * N);
  const output = gpu.allocator.createStorage('y', 'scratch', initial);
  const biasBuffer = bias ? gpu.allocator.createStorage('bias', 'weights', bias) : undefined;
  // The kernel compiled from the edited code: a view of the device whose matmul and matvec modules are edited.
  const target = transformSource ? mutateShaders(gpu, { label: /^mat(mul|vec)\b/, edit: transformSource }) : null;
  const dispatches = prepareMatmul(
    target?.gpu ?? gpu,
    'matmul-test',
    { weight, input, output, tokens: c.tokens, bias: biasBuffer, accumulate: c.accumulate },
    { variant: c.variant },
  );
  if (target) expect(target.mutated).toHaveLength(1);
  expect(dispatches.length).toBe(weight.parts.length);
  submitDispatches(gpu, 'matmul-test', dispatches);
  const actual = await readFloat32(gpu, output, c.tokens * N);
  releaseDispatches(gpu, dispatches);
  releaseWeight(gpu, weight);
  for (const b of [input, output, biasBuffer]) if (b) gpu.allocator.release(b);
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  const { y, magnitude } = matmulReference(dequantize(type, raw, K * N), x, K, N, c.tokens, bias);
  for (let i = 0; i < y.length; i++) {
    y[i] += initial[i];
    magnitude[i] += Math.abs(initial[i]);
  }
  return maxErrorRelativeToMagnitude(actual, y, magnitude, RTOL);
}

describe.each(TYPES)('matmul over %s weights', (name, type, K) => {
  it.each(perVariant(CASES))(
    `${name}: K=${K}, N=$rows, tokens=$tokens, bias=$bias, rows/part=$maxRowsPerPart, $kernel`,
    async (c) => {
      expect(await runMatmul(ctx.gpu, type, K, c)).toBeLessThanOrEqual(1);
    },
  );
});

// Adapters without subgroups (SwiftShader) get the matvec that reduces over workgroup memory; the test device
// (lavapipe) has subgroups and runs the subgroupAdd build above.
describe.each(TYPES)('matvec over %s weights without subgroups', (name, type, K) => {
  it.each([
    { tokens: 1, rows: 37, bias: true },
    { tokens: 1, rows: 37, bias: false, maxRowsPerPart: 16 },
  ])(`${name}: K=${K}, N=$rows, bias=$bias, rows/part=$maxRowsPerPart, tree reduction`, async (c) => {
    expect(await runMatmul(withFeatures(ctx.gpu, { subgroups: false }), type, K, c)).toBeLessThanOrEqual(1);
  });
});

// y += W·x: the residual connection folded into the projection, on every kernel (the store is the same code for
// every weight type).
describe.each([['Q4_K', GgmlType.Q4_K, 768]] as const)('accumulating matmul over %s weights', (name, type, K) => {
  it.each(
    perVariant([
      { tokens: 1, rows: 37, bias: true, accumulate: true },
      { tokens: 33, rows: 37, bias: false, accumulate: true, maxRowsPerPart: 16 },
    ]),
  )(`${name}: K=${K}, N=$rows, tokens=$tokens, bias=$bias, $kernel`, async (c) => {
    expect(await runMatmul(ctx.gpu, type, K, c)).toBeLessThanOrEqual(1);
  });
});

// Dense rows shorter than one K step, down to less than one vec4 (every k-quad of the tile partial or empty).
const SHORT_ROWS: [string, GgmlType, number][] = [
  ['F32', GgmlType.F32, 5],
  ['F16', GgmlType.F16, 3],
  ['BF16', GgmlType.BF16, 13],
  ['F32', GgmlType.F32, 35],
];

describe.each(SHORT_ROWS)('matmul over short %s rows', (name, type, K) => {
  it.each(perVariant([{ tokens: 3, rows: 5, bias: true }]))(`${name}: K=${K}, N=5, tokens=3, $kernel`, async (c) => {
    expect(await runMatmul(ctx.gpu, type, K, c)).toBeLessThanOrEqual(1);
  });
});

// Rows long enough that matvec threads walk several units (more units than threads, not a multiple of them; Q4_K at
// 4352: 136 units on 128 threads).
const LONG_ROWS: [string, GgmlType, number][] = [
  ['Q8_0', GgmlType.Q8_0, 1184],
  ['Q4_0', GgmlType.Q4_0, 1184],
  ['Q4_1', GgmlType.Q4_1, 1184],
  ['Q5_0', GgmlType.Q5_0, 1184],
  ['Q5_1', GgmlType.Q5_1, 1184],
  ['Q4_K', GgmlType.Q4_K, 4352],
  ['Q5_K', GgmlType.Q5_K, 1280],
  ['Q6_K', GgmlType.Q6_K, 2304],
  ['Q2_K', GgmlType.Q2_K, 2304],
  ['Q3_K', GgmlType.Q3_K, 2304],
  ['IQ4_NL', GgmlType.IQ4_NL, 1184],
  ['IQ4_XS', GgmlType.IQ4_XS, 1280],
  ['F16', GgmlType.F16, 1031],
];

describe.each(LONG_ROWS)('matmul over long %s rows', (name, type, K) => {
  it.each(perVariant([1, 3].map((tokens) => ({ tokens, rows: 9, bias: false }))))(
    `${name}: K=${K}, N=9, tokens=$tokens, $kernel`,
    async (c) => {
      expect(await runMatmul(ctx.gpu, type, K, c)).toBeLessThanOrEqual(1);
    },
  );
});

// The register-tiled kernel without the prefetch (the micro-bench compares both; no variant uses it).
describe.each([
  ['F32', GgmlType.F32, 35],
  ['Q4_0', GgmlType.Q4_0, 288],
  ['Q6_K', GgmlType.Q6_K, 768],
] as const)('64x64 matmul over %s weights without the prefetch', (name, type, K) => {
  it(`${name}: K=${K}, N=70, tokens=67`, async () => {
    const code = registerTiledMatmulWgsl(type, true, { ...MATMUL_TILES['64x64'], prefetch: false });
    const c: Case = { tokens: 67, rows: 70, bias: true, variant: '64x64' };
    expect(await runMatmul(ctx.gpu, type, K, c, () => code)).toBeLessThanOrEqual(1);
  });
});

describe('register-tiled matmul shapes', () => {
  it("every variant fits WebGPU's default limits (256 invocations, 16 KiB of workgroup memory)", () => {
    for (const tile of Object.values(MATMUL_TILES)) {
      const code = registerTiledMatmulWgsl(GgmlType.Q4_K, true, tile);
      const size = Number(/@workgroup_size\((\d+)\)/.exec(code)?.[1]);
      const vec4s = [...code.matchAll(/var<workgroup> \w+: array<vec4<f32>, (\d+)>/g)].map((m) => Number(m[1]));
      expect(size).toBeLessThanOrEqual(256);
      expect(vec4s.reduce((a, b) => a + b, 0) * 16).toBeLessThanOrEqual(16384);
    }
  });

  it('rejects tiles over those limits', () => {
    const big = { rows: 128, tokens: 128, rowsPerThread: 8, tokensPerThread: 8, k: 32, prefetch: true };
    expect(() => registerTiledMatmulWgsl(GgmlType.F32, false, big)).toThrow(/workgroup memory/);
    const many = { rows: 64, tokens: 64, rowsPerThread: 2, tokensPerThread: 4, k: 16, prefetch: true };
    expect(() => registerTiledMatmulWgsl(GgmlType.F32, false, many)).toThrow(/threads/);
  });
});

describe('matmul dispatch shape', () => {
  // A device that allows only 3 workgroups per dimension forces the row groups into x·y (matvec: 10 groups of 4
  // rows -> 4 x 3, one spare; matmul: 2 row tiles -> 2 x 1); the results must not change.
  it.each([1, 33])('folds row groups past the per-dimension limit (tokens=%i)', async (tokens) => {
    const { gpu } = ctx;
    const limited = withLimits(gpu, { maxComputeWorkgroupsPerDimension: 3 });
    const ratio = await runMatmul(limited, GgmlType.Q8_0, 288, { tokens, rows: 37, bias: true });
    expect(ratio).toBeLessThanOrEqual(1);
  });

  // 5 row tiles fold into 3 x 2 workgroups: the spare one must return without writing.
  it.each(MATMUL_VARIANTS)(
    'folds row tiles past the per-dimension limit with a spare workgroup (%s)',
    async (variant) => {
      const { gpu } = ctx;
      const limited = withLimits(gpu, { maxComputeWorkgroupsPerDimension: 3 });
      const rows = 4 * matmulTileShape(variant).rows + 5;
      const ratio = await runMatmul(limited, GgmlType.Q8_0, 288, { tokens: 33, rows, bias: true, variant });
      expect(ratio).toBeLessThanOrEqual(1);
    },
  );
});

describe('matmul bindings', () => {
  it('rejects buffers too small for the shapes instead of letting WebGPU clamp the accesses', () => {
    const { gpu } = ctx;
    const raw = randomWeightBytes(GgmlType.Q8_0, 64 * 8, seededRandom(2));
    const weight = uploadWeightFromBytes(gpu, 'w', GgmlType.Q8_0, [64, 8], raw);
    const input = gpu.allocator.createStorage('x', 'scratch', 2 * 64 * 4);
    const output = gpu.allocator.createStorage('y', 'scratch', 2 * 8 * 4);
    const small = gpu.allocator.createStorage('small', 'scratch', 8 * 4 - 4);
    expect(() => prepareMatmul(gpu, 'm', { weight, input, output, tokens: 3 })).toThrow(/input/);
    expect(() => prepareMatmul(gpu, 'm', { weight, input, output: small, tokens: 1 })).toThrow(/output/);
    expect(() => prepareMatmul(gpu, 'm', { weight, input, output, tokens: 2, bias: small })).toThrow(/bias/);
    releaseDispatches(gpu, prepareMatmul(gpu, 'm', { weight, input, output, tokens: 2, bias: output }));
    gpu.allocator.release(small);
    releaseWeight(gpu, weight);
    gpu.allocator.release(input);
    gpu.allocator.release(output);
  });
});

describe('matmul kernels catch broken code', () => {
  it('a Q4_0 matvec with the high-nibble elements shifted by one block position fails', async () => {
    let changed = false;
    const mutate = (code: string) => {
      const broken = code.replace('xv(xk + 16u)', 'xv(xk + 15u)');
      changed = broken !== code;
      return broken;
    };
    const ratio = await runMatmul(ctx.gpu, GgmlType.Q4_0, 288, { tokens: 1, rows: 37, bias: false }, mutate);
    expect(changed).toBe(true);
    expect(ratio).toBeGreaterThan(1);
  });

  it.each(MATMUL_VARIANTS)('a Q4_0 tiled matmul (%s) with the wrong nibble shift fails', async (variant) => {
    let changed = false;
    const mutate = (code: string) => {
      const broken = code.replace('select(0u, 4u, e >= 16u)', 'select(0u, 4u, e >= 12u)');
      changed = broken !== code;
      return broken;
    };
    const ratio = await runMatmul(ctx.gpu, GgmlType.Q4_0, 288, { tokens: 7, rows: 37, bias: false, variant }, mutate);
    expect(changed).toBe(true);
    expect(ratio).toBeGreaterThan(1);
  });

  // Each of Q2_K, Q3_K, IQ4_NL and IQ4_XS with one field of its layout misread, in the matvec (tokens = 1) and in the
  // tiled matmul's dequantization (tokens = 7): a sub-block's min or scale bits, the third bit's position, the nibble
  // order, one IQ4_NL level (level 8: 1 becomes 0).
  const LAYOUT_MUTATIONS: [string, GgmlType, number, Case, string, string][] = [
    [
      'a Q2_K matvec reading scales as mins',
      GgmlType.Q2_K,
      768,
      { tokens: 1, rows: 37, bias: false },
      'dm.y * dot(mn,',
      'dm.y * dot(sc,',
    ],
    [
      'a Q2_K matmul reading the min as the scale',
      GgmlType.Q2_K,
      768,
      { tokens: 7, rows: 37, bias: false },
      'dm.y * f32(sc >> 4u)',
      'dm.y * f32(sc & 15u)',
    ],
    [
      'a Q3_K matvec with the third bit of the wrong shift',
      GgmlType.Q3_K,
      768,
      { tokens: 1, rows: 37, bias: false },
      '(hm >> 3u)',
      '(hm >> 2u)',
    ],
    [
      'a Q3_K matmul with the third bit of the wrong shift',
      GgmlType.Q3_K,
      768,
      { tokens: 7, rows: 37, bias: false },
      '(4u * n + j)',
      '(4u * n + j + 1u)',
    ],
    [
      'an IQ4_NL matvec with one level wrong',
      GgmlType.IQ4_NL,
      288,
      { tokens: 1, rows: 37, bias: false },
      '0x26190d01u',
      '0x26190d00u',
    ],
    [
      'an IQ4_NL matmul with the nibbles swapped past 12',
      GgmlType.IQ4_NL,
      288,
      { tokens: 7, rows: 37, bias: false },
      'e >= 16u',
      'e >= 12u',
    ],
    [
      'an IQ4_XS matvec with the high scale bits shifted',
      GgmlType.IQ4_XS,
      768,
      { tokens: 1, rows: 37, bias: false },
      '(16u + 2u * sb)',
      '(17u + 2u * sb)',
    ],
    [
      'an IQ4_XS matmul with the high scale bits shifted',
      GgmlType.IQ4_XS,
      768,
      { tokens: 7, rows: 37, bias: false },
      '(16u + 2u * b)',
      '(17u + 2u * b)',
    ],
  ];
  it.each(LAYOUT_MUTATIONS)('%s fails', async (_, type, K, c, from, to) => {
    let changed = false;
    const mutate = (code: string) => {
      const broken = code.replace(from, to);
      changed = broken !== code;
      return broken;
    };
    const ratio = await runMatmul(ctx.gpu, type, K, { ...c, variant: '64x64' }, mutate);
    expect(changed).toBe(true);
    expect(ratio).toBeGreaterThan(1);
  });

  // The edges of the register-tiled kernels. k past K is zeroed on both sides (either alone would do while the other
  // side reads finite values), so only breaking both must fail. Rows past a part's end write into other parts'
  // outputs (and those of the next token); the last part is dispatched last, so the damage stays.
  const EDGE_MUTATIONS: [string, [string, string][], Case][] = [
    [
      'k past K is not zeroed',
      [
        [', kin);', ', vec4<bool>(true));'],
        ['k < vec4<u32>(params.K));', 'vec4<bool>(true));'],
      ],
      { tokens: 7, rows: 37, bias: false },
    ],
    [
      'rows past the end are written',
      [['r < params.rows) {', 'r < params.rows + 9u) {']],
      { tokens: 7, rows: 37, bias: false, maxRowsPerPart: 13 },
    ],
  ];
  it.each(EDGE_MUTATIONS)('a register-tiled matmul where %s fails', async (_, edits, c) => {
    let changed = 0;
    const mutate = (code: string) => {
      for (const [from, to] of edits) {
        const broken = code.replace(from, to);
        if (broken !== code) changed++;
        code = broken;
      }
      return code;
    };
    const ratio = await runMatmul(ctx.gpu, GgmlType.F32, 35, { ...c, variant: '64x64' }, mutate);
    expect(changed).toBe(edits.length);
    expect(ratio).toBeGreaterThan(1);
  });
});

describe('defaultMatmulVariant', () => {
  it('takes the 64x64 tile only where its grid has >= 256 workgroups', () => {
    expect(defaultMatmulVariant(2048, 128)).toBe('32x32'); // 32 x 2 = 64 workgroups
    expect(defaultMatmulVariant(2048, 512)).toBe('64x64'); // 32 x 8 = 256
    expect(defaultMatmulVariant(8192, 128)).toBe('64x64'); // 128 x 2
    expect(defaultMatmulVariant(151936, 2)).toBe('64x64');
    expect(defaultMatmulVariant(896, 128)).toBe('32x32');
  });
});
