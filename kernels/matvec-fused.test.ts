import { describe, expect, it } from 'vitest';
import { GgmlType } from '../runtime/gguf/types.ts';
import type { GpuContext } from '../runtime/gpu/device.ts';
import { readFloat32 } from '../runtime/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { type PreparedDispatch, releaseDispatches, submitDispatches } from './dispatch.ts';
import { prepareSwiglu } from './elementwise.ts';
import { prepareMatmul, prepareMatvecGroup, prepareMatvecSwiglu } from './matmul.ts';
import { dequantize, randomWeightBytes } from './reference/dequantize.ts';
import { swigluReference } from './reference/elementwise.ts';
import { matmulReference, maxErrorRelativeToMagnitude } from './reference/matmul.ts';
import { rmsnormReference } from './reference/rmsnorm.ts';
import { releaseWeight, uploadWeightFromBytes } from './weights.ts';

const ctx = withTestGpu();
const RTOL = 1e-4;

/** A random weight of `rows` rows of K elements, on the GPU and dequantized on the CPU. */
function makeWeight(type: GgmlType, K: number, rows: number, seed: number, maxRowsPerPart?: number) {
  const raw = randomWeightBytes(type, K * rows, seededRandom(seed));
  const weight = uploadWeightFromBytes(ctx.gpu, `w${seed}`, type, [K, rows], raw, { maxRowsPerPart });
  return { weight, dense: dequantize(type, raw, K * rows) };
}

const K = 768;
const EPS = 1e-5;

/**
 * The input of a fused matvec: plain x, or (normed) the raw residual stream with a norm weight, where the reference
 * input is rmsnorm(x) on the CPU. The raw stream is scaled by 3 so a missing normalization cannot pass.
 */
function makeInput(random: () => number, normed: boolean) {
  const { gpu } = ctx;
  const x = randomFloats(random, K, normed ? 3 : 1);
  const input = gpu.allocator.createStorage('x', 'scratch', x);
  if (!normed) return { input, xRef: x, norm: undefined, releaseNorm: () => {} };
  const weight = Float32Array.from({ length: K }, () => 0.5 + random());
  const buffer = gpu.allocator.createStorage('norm', 'weights', weight);
  return {
    input,
    xRef: rmsnormReference(x, weight, 1, K, EPS),
    norm: { weight: buffer, eps: EPS },
    releaseNorm: () => gpu.allocator.release(buffer),
  };
}

async function run(dispatches: PreparedDispatch[], outputs: GPUBuffer[], lengths: number[]): Promise<Float32Array[]> {
  submitDispatches(ctx.gpu, 'fused-test', dispatches);
  const out = await Promise.all(outputs.map((b, i) => readFloat32(ctx.gpu, b, lengths[i])));
  releaseDispatches(ctx.gpu, dispatches);
  return out;
}

// q, k, v of a decode step: different types and row counts (none a multiple of the 4 rows per workgroup), biases on
// two of them (Qwen2 has all three; the binding count decides what fits).
const MEMBERS: { type: GgmlType; rows: number; bias: boolean }[] = [
  { type: GgmlType.Q4_K, rows: 37, bias: true },
  { type: GgmlType.Q6_K, rows: 21, bias: false },
  { type: GgmlType.F16, rows: 9, bias: true },
];

describe('matvec group (q, k, v in one dispatch)', () => {
  async function runGroup(transform?: (code: string) => string, normed = false) {
    const { gpu } = ctx;
    const random = seededRandom(11);
    const { input, xRef, norm, releaseNorm } = makeInput(random, normed);
    const members = MEMBERS.map((m, i) => ({
      ...makeWeight(m.type, K, m.rows, 100 + i),
      bias: m.bias ? randomFloats(random, m.rows, 0.5) : undefined,
      rows: m.rows,
    }));
    const entries = members.map((m) => ({
      weight: m.weight,
      output: gpu.allocator.createStorage('y', 'scratch', m.rows * 4),
      bias: m.bias ? gpu.allocator.createStorage('bias', 'weights', m.bias) : undefined,
    }));
    const group = prepareMatvecGroup(gpu, 'group', input, entries, { transformSource: transform, norm });
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
      const { y, magnitude } = matmulReference(m.dense, xRef, K, m.rows, 1, m.bias);
      return maxErrorRelativeToMagnitude(fused[i], y, magnitude, RTOL);
    });
    for (const e of [...entries, ...apart]) {
      gpu.allocator.release(e.output);
    }
    for (const e of entries) if (e.bias) gpu.allocator.release(e.bias);
    for (const m of members) releaseWeight(gpu, m.weight);
    gpu.allocator.release(input);
    releaseNorm();
    return { fused, separate, ratios };
  }

  it('matches the CPU reference for every member, and equals one matvec dispatch per weight exactly', async () => {
    const { fused, separate, ratios } = await runGroup();
    for (const r of ratios) expect(r).toBeLessThanOrEqual(1);
    expect(fused).toEqual(separate);
  });

  it('with the RMSNorm fused in: matches the CPU reference of norm then matvec, for every member', async () => {
    const { ratios } = await runGroup(undefined, true);
    for (const r of ratios) expect(r).toBeLessThanOrEqual(1);
  });

  it('catches a broken fused norm (x not normalized, only weighted)', async () => {
    const { ratios } = await runGroup((code) => {
      const broken = code.replace('* scale * normWeight[i]', '* normWeight[i]');
      expect(broken).not.toBe(code);
      return broken;
    }, true);
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });

  it('catches a broken kernel (every workgroup reads the first member)', async () => {
    const { ratios } = await runGroup((code) => {
      const broken = code.replace('member = i;', 'member = 0u;');
      expect(broken).not.toBe(code);
      return broken;
    });
    expect(Math.max(...ratios)).toBeGreaterThan(1);
  });

  it('declines weights split into parts (the caller then dispatches them one by one)', () => {
    const { gpu } = ctx;
    const split = makeWeight(GgmlType.Q8_0, 64, 8, 3, 4);
    const whole = makeWeight(GgmlType.Q8_0, 64, 8, 4);
    const input = gpu.allocator.createStorage('x', 'scratch', 64 * 4);
    const output = gpu.allocator.createStorage('y', 'scratch', 8 * 4);
    expect(
      prepareMatvecGroup(gpu, 'g', input, [
        { weight: whole.weight, output },
        { weight: split.weight, output },
      ]),
    ).toBeNull();
    expect(prepareMatvecSwiglu(gpu, 's', { gate: split.weight, up: whole.weight, input, output })).toBeNull();
    for (const w of [split.weight, whole.weight]) releaseWeight(gpu, w);
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
    normed = false,
  ) {
    const { gpu } = ctx;
    const random = seededRandom(rows * 13 + gateType);
    const { input, xRef, norm, releaseNorm } = makeInput(random, normed);
    const gate = makeWeight(gateType, K, rows, 200);
    const up = makeWeight(upType, K, rows, 201);
    const output = gpu.allocator.createStorage('y', 'scratch', rows * 4);
    const fusedDispatch = prepareMatvecSwiglu(
      gpu,
      'swiglu',
      { gate: gate.weight, up: up.weight, input, output },
      { transformSource: transform, norm },
    );
    if (!fusedDispatch) throw new Error('expected one dispatch');
    const [fused] = await run([fusedDispatch], [output], [rows]);
    const g = gpu.allocator.createStorage('g', 'scratch', rows * 4);
    const u = gpu.allocator.createStorage('u', 'scratch', rows * 4);
    const h = gpu.allocator.createStorage('h', 'scratch', rows * 4);
    const [separate] = await run(
      [
        ...prepareMatmul(gpu, 'gate', { weight: gate.weight, input, output: g, tokens: 1 }),
        ...prepareMatmul(gpu, 'up', { weight: up.weight, input, output: u, tokens: 1 }),
        prepareSwiglu(gpu, 'swiglu', { gate: g, up: u, output: h, count: rows }),
      ],
      [h],
      [rows],
    );
    const gateRef = matmulReference(gate.dense, xRef, K, rows, 1).y;
    const upRef = matmulReference(up.dense, xRef, K, rows, 1).y;
    const expected = swigluReference(gateRef, upRef);
    for (const b of [input, output, g, u, h]) gpu.allocator.release(b);
    releaseWeight(gpu, gate.weight);
    releaseWeight(gpu, up.weight);
    releaseNorm();
    return { fused, separate, expected };
  }

  it.each([
    [GgmlType.Q4_K, GgmlType.Q4_K, 37],
    [GgmlType.Q4_K, GgmlType.Q6_K, 22],
    [GgmlType.Q8_0, GgmlType.F16, 9],
  ])(
    'gate type %i, up type %i, %i rows: matches the CPU reference and the three dispatches exactly',
    async (gt, ut, rows) => {
      const { fused, separate, expected } = await runSwiglu(gt, ut, rows);
      // Outputs are O(10); f32 sums over 768 products err by ~1e-5 of that.
      expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
      expect(fused).toEqual(separate);
    },
  );

  it('with the RMSNorm fused in: matches the CPU reference of norm, gate, up and SwiGLU', async () => {
    const { fused, expected } = await runSwiglu(GgmlType.Q4_K, GgmlType.Q6_K, 22, undefined, true);
    expect(maxToleranceRatio(fused, expected, 1e-4, 1e-4)).toBeLessThanOrEqual(1);
  });

  it('declines a fused norm whose copy of x does not fit workgroup memory', () => {
    const { gpu } = ctx;
    const small = Object.assign(Object.create(gpu) as GpuContext, {
      limits: { ...gpu.limits, maxComputeWorkgroupStorageSize: 4096 + 1024 },
    });
    const gate = makeWeight(GgmlType.Q8_0, 1024, 8, 5);
    const input = gpu.allocator.createStorage('x', 'scratch', 1024 * 4);
    const output = gpu.allocator.createStorage('y', 'scratch', 8 * 4);
    const norm = { weight: input, eps: 1e-5 };
    const binding = { gate: gate.weight, up: gate.weight, input, output };
    // 2 x 2 KiB of partial sums fit; with 4 KiB more for the normalized x they do not.
    expect(prepareMatvecSwiglu(small, 's', binding, { norm })).toBeNull();
    const plain = prepareMatvecSwiglu(small, 's', binding);
    expect(plain).not.toBeNull();
    if (plain) releaseDispatches(gpu, [plain]);
    releaseWeight(gpu, gate.weight);
    gpu.allocator.release(input);
    gpu.allocator.release(output);
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
