import { describe, expect, it } from 'vitest';
import { GgmlType } from '../core/gguf-types.ts';
import { type PreparedDispatch, releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { withFeatures, withLimits, withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { prepareSwiglu } from './elementwise.ts';
import type { GatedActivation } from './elementwise.wgsl.ts';
import { matvecThreadsFor, prepareMatmul, prepareMatvecGroup, prepareMatvecSwiglu } from './matmul.ts';
import { dequantize, randomWeightBytes } from './reference/dequantize.ts';
import { gegluReference, swigluReference } from './reference/elementwise.ts';
import { matmulReference, maxErrorRelativeToMagnitude } from './reference/matmul.ts';
import { releaseWeight, uploadWeightFromBytes } from './weights.ts';

const ctx = withTestGpu();
const RTOL = 1e-4;

/** A random weight of `rows` rows of K elements, on the GPU and dequantized on the CPU. */
function makeWeight(type: GgmlType, K: number, rows: number, seed: number, maxRowsPerPart?: number) {
  const raw = randomWeightBytes(type, K * rows, seededRandom(seed));
  const weight = uploadWeightFromBytes(ctx.gpu, `w${seed}`, type, [K, rows], raw, { maxRowsPerPart });
  return { weight, dense: dequantize(type, raw, K * rows) };
}

async function run(dispatches: PreparedDispatch[], outputs: GPUBuffer[], lengths: number[]): Promise<Float32Array[]> {
  submitDispatches(ctx.gpu, 'fused-test', dispatches);
  const out = await Promise.all(outputs.map((b, i) => readFloat32(ctx.gpu, b, lengths[i])));
  releaseDispatches(ctx.gpu, dispatches);
  return out;
}

type Member = { type: GgmlType; rows: number; bias: boolean };

// q, k, v of a decode step: different types and row counts (none a multiple of the 4 rows per workgroup), a bias on
// one (8 storage bindings, WebGPU's minimum). With a dense member x is read as scalars; MIXED's members also differ
// in their own thread counts (Q4_K: 24 units, 32 threads; Q6_K: 48, 64; F16: 384, 128).
const MIXED: Member[] = [
  { type: GgmlType.Q4_K, rows: 37, bias: true },
  { type: GgmlType.Q6_K, rows: 21, bias: false },
  { type: GgmlType.F16, rows: 9, bias: false },
];
// All quantized, as in a Q4_K_M model: x is read as vec4s.
const QUANTIZED: Member[] = [
  { type: GgmlType.Q4_K, rows: 37, bias: true },
  { type: GgmlType.Q4_K, rows: 21, bias: false },
  { type: GgmlType.Q6_K, rows: 9, bias: false },
];
// The low-bit types of Q2_K/Q3_K/IQ4_XS files (16, 16 and 32 units per block: 48, 48 and 96 units, 64 and 96 threads).
const LOW_BIT: Member[] = [
  { type: GgmlType.Q3_K, rows: 37, bias: true },
  { type: GgmlType.Q2_K, rows: 21, bias: false },
  { type: GgmlType.IQ4_XS, rows: 9, bias: false },
];
const K = 768;
// Qwen3-4B's rows of 2,560: Q4_K members of 80 units run on 96 threads (not a power of two), Q6_K's 160 on 128.
const QWEN3_K = 2560;

describe('matvec group (q, k, v in one dispatch)', () => {
  async function runGroup(spec: Member[], transform?: (code: string) => string, gpu = ctx.gpu, rowLength = K) {
    const random = seededRandom(11);
    const x = randomFloats(random, rowLength, 1);
    const input = gpu.allocator.createStorage('x', 'scratch', x);
    const members = spec.map((m, i) => ({
      ...makeWeight(m.type, rowLength, m.rows, 100 + i),
      bias: m.bias ? randomFloats(random, m.rows, 0.5) : undefined,
      rows: m.rows,
    }));
    const entries = members.map((m) => ({
      weight: m.weight,
      output: gpu.allocator.createStorage('y', 'scratch', m.rows * 4),
      bias: m.bias ? gpu.allocator.createStorage('bias', 'weights', m.bias) : undefined,
    }));
    const target = transform ? mutateShaders(gpu, { label: 'matvec group', edit: transform }) : null;
    const group = prepareMatvecGroup(target?.gpu ?? gpu, 'group', input, entries);
    if (target) expect(target.mutated).toEqual(['matvec group']);
    if (!group) throw new Error('expected one dispatch');
    const fused = await run(
      [group],
      entries.map((e) => e.output),
      members.map((m) => m.rows),
    );
    // The same weights one prepareMatmul each, into fresh outputs.
    const apart = entries.map((e) => ({
      ...e,
      output: gpu.allocator.createStorage('y2', 'scratch', e.weight.rows * 4),
    }));
    const separate = await run(
      apart.flatMap((e, i) =>
        prepareMatmul(gpu, `m${i}`, { weight: e.weight, input, output: e.output, tokens: 1, bias: e.bias }),
      ),
      apart.map((e) => e.output),
      members.map((m) => m.rows),
    );
    const ratios = members.map((m, i) => {
      const { y, magnitude } = matmulReference(m.dense, x, rowLength, m.rows, 1, m.bias);
      return maxErrorRelativeToMagnitude(fused[i], y, magnitude, RTOL);
    });
    for (const e of [...entries, ...apart]) {
      gpu.allocator.release(e.output);
    }
    for (const e of entries) if (e.bias) gpu.allocator.release(e.bias);
    for (const m of members) releaseWeight(gpu, m.weight);
    gpu.allocator.release(input);
    return { fused, separate, ratios };
  }

  it.each([
    ['quantized members (x as vec4s)', QUANTIZED],
    ['a dense member (x as scalars) and different thread counts', MIXED],
    ['Q3_K, Q2_K and IQ4_XS members', LOW_BIT],
  ] as const)(
    '%s: matches the CPU reference for every member and equals one matvec dispatch per weight exactly',
    async (_, spec) => {
      const { fused, separate, ratios } = await runGroup(spec);
      for (const r of ratios) expect(r).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  it('members run with their own thread counts', () => {
    expect(MIXED.map((m) => matvecThreadsFor(m.type, K))).toEqual([32, 64, 128]);
    expect(QUANTIZED.map((m) => matvecThreadsFor(m.type, QWEN3_K))).toEqual([96, 96, 128]);
  });

  it.each([
    ['subgroupAdd', true],
    ['workgroup-memory tree', false],
  ] as const)(
    'members of 96 threads in a workgroup of 128 (Qwen3-4B rows) match the reference and their own dispatches exactly (%s reduction)',
    async (_, subgroups) => {
      const gpu = withFeatures(ctx.gpu, { subgroups });
      const { fused, separate, ratios } = await runGroup(QUANTIZED, undefined, gpu, QWEN3_K);
      for (const r of ratios) expect(r).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  // 19 row groups of 4 rows (10 + 6 + 3) fold into 3 x 7 = 21 workgroups: the 2 spare ones resolve to the last
  // member, past its rows, and must not write.
  it('folds its row groups past the per-dimension limit', async () => {
    const limited = withLimits(ctx.gpu, { maxComputeWorkgroupsPerDimension: 3 });
    const { ratios } = await runGroup(QUANTIZED, undefined, limited);
    for (const r of ratios) expect(r).toBeLessThanOrEqual(1);
  });

  it('catches a broken kernel (every workgroup reads the first member)', async () => {
    const { ratios } = await runGroup(MIXED, (code) => {
      const broken = code.replace('member = i;', 'member = 0u;');
      expect(broken).not.toBe(code);
      return broken;
    });
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });

  it('declines what one dispatch cannot do (the caller then dispatches the weights one by one)', () => {
    const { gpu } = ctx;
    const split = makeWeight(GgmlType.Q8_0, 64, 8, 3, 4);
    const whole = makeWeight(GgmlType.Q8_0, 64, 8, 4);
    const longer = makeWeight(GgmlType.Q8_0, 96, 8, 5);
    const input = gpu.allocator.createStorage('x', 'scratch', 96 * 4);
    const output = gpu.allocator.createStorage('y', 'scratch', 8 * 4);
    const group = (g: typeof gpu, weights: (typeof whole)[]) =>
      prepareMatvecGroup(
        g,
        'g',
        input,
        weights.map((w) => ({ weight: w.weight, output })),
      );
    // A weight split into parts; rows of different lengths; more storage bindings than the device has (1 + 2 + 2).
    expect(group(gpu, [whole, split])).toBeNull();
    expect(group(gpu, [whole, longer])).toBeNull();
    expect(group(withLimits(gpu, { maxStorageBuffersPerShaderStage: 4 }), [whole, whole])).toBeNull();
    expect(prepareMatvecSwiglu(gpu, 's', { gate: split.weight, up: whole.weight, input, output })).toBeNull();
    expect(prepareMatvecSwiglu(gpu, 's', { gate: longer.weight, up: whole.weight, input, output })).toBeNull();
    expect(() => prepareMatvecGroup(gpu, 'g', input, [])).toThrow(/no weights/);
    for (const w of [split, whole, longer]) releaseWeight(gpu, w.weight);
    gpu.allocator.release(input);
    gpu.allocator.release(output);
  });
});

describe('matvec SwiGLU (gate, up and silu(gate)·up in one dispatch)', () => {
  async function runSwiglu(
    gateType: GgmlType,
    upType: GgmlType,
    rows: number,
    transform?: (code: string) => string,
    gpu = ctx.gpu,
    rowLength = K,
    activation: GatedActivation = 'swiglu',
  ) {
    const random = seededRandom(rows * 13 + gateType);
    const x = randomFloats(random, rowLength, 1);
    const gate = makeWeight(gateType, rowLength, rows, 200);
    const up = makeWeight(upType, rowLength, rows, 201);
    const input = gpu.allocator.createStorage('x', 'scratch', x);
    const output = gpu.allocator.createStorage('y', 'scratch', rows * 4);
    const label = `matvec ${activation}`;
    const target = transform ? mutateShaders(gpu, { label, edit: transform }) : null;
    const fusedDispatch = prepareMatvecSwiglu(target?.gpu ?? gpu, activation, {
      gate: gate.weight,
      up: up.weight,
      input,
      output,
      activation,
    });
    if (target) expect(target.mutated).toEqual([label]);
    if (!fusedDispatch) throw new Error('expected one dispatch');
    const [fused] = await run([fusedDispatch], [output], [rows]);
    const g = gpu.allocator.createStorage('g', 'scratch', rows * 4);
    const u = gpu.allocator.createStorage('u', 'scratch', rows * 4);
    const h = gpu.allocator.createStorage('h', 'scratch', rows * 4);
    const [separate] = await run(
      [
        ...prepareMatmul(gpu, 'gate', { weight: gate.weight, input, output: g, tokens: 1 }),
        ...prepareMatmul(gpu, 'up', { weight: up.weight, input, output: u, tokens: 1 }),
        prepareSwiglu(gpu, activation, { gate: g, up: u, output: h, count: rows, activation }),
      ],
      [h],
      [rows],
    );
    const gateRef = matmulReference(gate.dense, x, rowLength, rows, 1).y;
    const upRef = matmulReference(up.dense, x, rowLength, rows, 1).y;
    const expected = (activation === 'geglu' ? gegluReference : swigluReference)(gateRef, upRef);
    for (const b of [input, output, g, u, h]) gpu.allocator.release(b);
    releaseWeight(gpu, gate.weight);
    releaseWeight(gpu, up.weight);
    return { fused, separate, expected };
  }

  it.each([
    [GgmlType.Q4_K, GgmlType.Q4_K, 37],
    [GgmlType.Q4_K, GgmlType.Q6_K, 22],
    [GgmlType.Q8_0, GgmlType.F16, 9],
    [GgmlType.IQ4_NL, GgmlType.Q3_K, 11],
    // Gate on 32 threads (24 units), up on 128 (384 words): the workgroup has 128.
    [GgmlType.Q4_K, GgmlType.F16, 13],
  ])(
    'gate type %i, up type %i, %i rows: matches the CPU reference and the three dispatches exactly',
    async (gt, ut, rows) => {
      const { fused, separate, expected } = await runSwiglu(gt, ut, rows);
      // Outputs are O(10); f32 sums over 768 products err by ~1e-5 of that.
      expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  // Qwen3-4B's gate_up: Q4_K rows of 2,560 on 96 threads (two partial arrays folded), with a Q6_K up on 128.
  // Both reductions: subgroupAdd (the test device has subgroups) and the tree over workgroup memory.
  it.each([
    [GgmlType.Q4_K, GgmlType.Q4_K, 21, true],
    [GgmlType.Q4_K, GgmlType.Q6_K, 10, true],
    [GgmlType.Q4_K, GgmlType.Q6_K, 10, false],
  ])(
    'gate type %i, up type %i, %i rows of 2,560, subgroups %s: matches the CPU reference and the three dispatches exactly',
    async (gt, ut, rows, subgroups) => {
      const gpu = withFeatures(ctx.gpu, { subgroups });
      const { fused, separate, expected } = await runSwiglu(gt, ut, rows, undefined, gpu, QWEN3_K);
      expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  // 37 rows: 10 row groups fold into 3 x 4 = 12 workgroups, 2 spare.
  it('folds its row groups past the per-dimension limit', async () => {
    const limited = withLimits(ctx.gpu, { maxComputeWorkgroupsPerDimension: 3 });
    const { fused, expected } = await runSwiglu(GgmlType.Q4_K, GgmlType.Q6_K, 37, undefined, limited);
    expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
  });

  // Gemma's GeGLU: the same dispatch with gelu's tanh form in place of silu.
  it.each([
    [GgmlType.Q4_K, GgmlType.Q6_K, 22],
    [GgmlType.Q8_0, GgmlType.F16, 9],
  ])(
    'GeGLU: gate type %i, up type %i, %i rows: matches the CPU reference and the three dispatches exactly',
    async (gt, ut, rows) => {
      const { fused, separate, expected } = await runSwiglu(gt, ut, rows, undefined, ctx.gpu, K, 'geglu');
      expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  // The gates here are large (|g| of tens): gelu is nearly g or 0 there, so the break flips the sigmoid.
  it('catches a broken GeGLU kernel (its sigmoid mirrored)', async () => {
    const edit = (code: string) => code.replace('exp(-1.5957691216057308', 'exp(1.5957691216057308');
    const { fused, expected } = await runSwiglu(GgmlType.Q8_0, GgmlType.F16, 9, edit, ctx.gpu, K, 'geglu');
    expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeGreaterThan(1);
  });

  it('catches a broken kernel (up read with the gate row stride)', async () => {
    const { fused, expected } = await runSwiglu(GgmlType.Q4_K, GgmlType.Q6_K, 22, (code) => {
      const broken = code.replaceAll('* params.upRowWords;', '* params.gateRowWords;');
      expect(broken).not.toBe(code);
      return broken;
    });
    expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeGreaterThan(1);
  });
});
