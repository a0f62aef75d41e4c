import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches, uniformBuffer } from '../core/gpu/dispatch.ts';
import { readFloat32, readUint32 } from '../core/gpu/readback.ts';
import { decodePageEntry, KvPagePool } from '../runtime/kv/pool.ts';
import { hadamardMatrix, rotationSet } from '../runtime/kv/rotation.ts';
import { withLimits, withTestGpu } from '../test/gpu.ts';
import { maxToleranceRatio, randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { f16BitsToNumber } from './reference/attention.ts';
import { ropeAppendReference } from './reference/rope-append.ts';
import { NO_ROPE_SCALING, type RopeLayout, type RopeStage, ropeFrequencyDivisors } from './rope.ts';
import { prepareRopeAppend, ropeAppendFits } from './rope-append.ts';

const ctx = withTestGpu();

interface Case {
  layout: RopeLayout;
  heads: number;
  kvHeads: number;
  headDim: number;
  ropeDim: number;
  position: number;
  headNorm: boolean;
  /** None, or one matrix per (layer, KV head): Hadamard, or a distinct random orthogonal matrix each. */
  rotation: 'none' | 'hadamard' | 'calibrated';
}

const LAYERS = 2;
const LAYER = 1;
const PAGE_TOKENS = 4;

/**
 * A distinct dense orthogonal matrix per (layer, KV head), not symmetric: the Hadamard matrix with random column signs
 * and its rows shuffled. A head that reads another's matrix, or its transpose, shows.
 */
function calibratedSet(random: () => number, n: number, headDim: number): Float32Array {
  const hadamard = hadamardMatrix(headDim);
  const set = new Float32Array(n * headDim * headDim);
  for (let m = 0; m < n; m++) {
    const signs = Array.from({ length: headDim }, () => (random() < 0.5 ? -1 : 1));
    const rows = Array.from({ length: headDim }, (_, i) => i);
    for (let i = headDim - 1; i > 0; i--) {
      const j = Math.floor(random() * (i + 1));
      [rows[i], rows[j]] = [rows[j], rows[i]];
    }
    for (let i = 0; i < headDim; i++) {
      for (let j = 0; j < headDim; j++) {
        set[(m * headDim + i) * headDim + j] = hadamard[rows[i] * headDim + j] * signs[j];
      }
    }
  }
  return set;
}

/**
 * Runs one decode step of the fused kernel at `c.position` (earlier positions' pages reserved and left zero) and
 * returns how far q and the layer's page rows around the step are from the reference: the step's row must hold the
 * reference's k and v rounded to f16, the rows before it must stay zero.
 */
async function runCase(gpu: GpuContext, c: Case) {
  const before = gpu.allocator.snapshot().totalBuffers;
  const random = seededRandom(c.heads * 131 + c.headDim * 7 + c.position + (c.headNorm ? 1 : 0));
  const { heads, kvHeads, headDim, ropeDim } = c;
  const pageBytes = LAYERS * 2 * kvHeads * PAGE_TOKENS * headDim * 2;
  const budgetBytes = (Math.ceil((c.position + 1) / PAGE_TOKENS) + 4) * pageBytes;
  const pool = new KvPagePool(gpu, { layers: LAYERS, kvHeads, headDim, pageTokens: PAGE_TOKENS, budgetBytes });
  const q = randomFloats(random, heads * headDim, 2);
  const k = randomFloats(random, kvHeads * headDim, 2);
  const v = randomFloats(random, kvHeads * headDim, 1);
  const factors = Float32Array.from({ length: ropeDim / 2 }, () => 1 + random() * 8);
  const eps = 1e-6;
  const qNorm = Float32Array.from({ length: headDim }, () => 0.25 + 2 * random());
  const kNorm = Float32Array.from({ length: headDim }, () => 0.25 + 2 * random());
  const matrices =
    c.rotation === 'none'
      ? null
      : c.rotation === 'hadamard'
        ? {
            key: rotationSet('hadamard', LAYERS, kvHeads, headDim),
            value: rotationSet('hadamard', LAYERS, kvHeads, headDim),
          }
        : {
            key: calibratedSet(random, LAYERS * kvHeads, headDim),
            value: calibratedSet(random, LAYERS * kvHeads, headDim),
          };
  const owned: GPUBuffer[] = [];
  const storage = (label: string, data: Float32Array) => {
    const buffer = gpu.allocator.createStorage(label, 'scratch', data);
    owned.push(buffer);
    return buffer;
  };
  const qBuffer = storage('q', q);
  const step = uniformBuffer(gpu, 'step', [c.position, 1, 0, 0], 'uuuu');
  owned.push(step);
  const rope: RopeStage = {
    freqFactors: storage('factors', ropeFrequencyDivisors(ropeDim, 10000, NO_ROPE_SCALING, factors)),
    step,
    heads,
    kvHeads,
    headDim,
    ropeDim,
    base: 10000,
    layout: c.layout,
    headNorm: c.headNorm ? { q: storage('q_norm', qNorm), k: storage('k_norm', kNorm), eps } : undefined,
  };
  const dispatch = prepareRopeAppend(gpu, 'rope-append-test', {
    pool,
    layer: LAYER,
    q: qBuffer,
    k: storage('k', k),
    v: storage('v', v),
    rope,
    rotation: matrices
      ? { key: storage('rk', matrices.key), value: storage('rv', matrices.value), firstMatrix: LAYER * kvHeads }
      : undefined,
  });
  const seq = pool.createSequence();
  // The positions before the step's hold what earlier steps would have stored (here nothing: zeros).
  if (c.position > 0) pool.writeStep(seq, 0, c.position);
  pool.writeStep(seq, c.position, 1);
  pool.submitPending();
  submitDispatches(gpu, 'rope-append-test', [dispatch]);
  const actualQ = await readFloat32(gpu, qBuffer, q.length);
  const slabs = pool.slabBindings();
  const slabWords = await Promise.all(slabs.slice(0, pool.stats().slabs).map((s) => readUint32(gpu, s, s.size / 4)));
  const expected = ropeAppendReference({
    q,
    k,
    v,
    heads,
    kvHeads,
    headDim,
    ropeDim,
    base: 10000,
    layout: c.layout,
    position: c.position,
    freqFactors: factors,
    headNorm: c.headNorm ? { q: qNorm, k: kNorm, eps } : undefined,
    rotation: matrices ? { ...matrices, firstMatrix: LAYER * kvHeads } : undefined,
  });
  // The rows of the layer in the step's page and the page before: the step's holds k and v, the others zeros.
  const stored: number[] = [];
  const wanted: number[] = [];
  const firstChecked = Math.max(0, (Math.floor(c.position / PAGE_TOKENS) - 1) * PAGE_TOKENS);
  for (let pos = firstChecked; pos <= c.position; pos++) {
    const { slab, page } = decodePageEntry(seq.pages[Math.floor(pos / PAGE_TOKENS)]);
    for (const kv of [0, 1] as const) {
      const source = kv === 0 ? expected.k : expected.v;
      for (let h = 0; h < kvHeads; h++) {
        for (let w = 0; w < headDim / 2; w++) {
          const word =
            slabWords[slab][
              page * pool.pageWords +
                pool.layerOffsetWords(LAYER, kv) +
                (h * PAGE_TOKENS + (pos % PAGE_TOKENS)) * (headDim / 2) +
                w
            ];
          stored.push(f16BitsToNumber(word & 0xffff), f16BitsToNumber(word >>> 16));
          const at = h * headDim + 2 * w;
          wanted.push(...(pos === c.position ? [source[at], source[at + 1]] : [0, 0]));
        }
      }
    }
  }
  releaseDispatches(gpu, [dispatch]);
  for (const b of owned) gpu.allocator.release(b);
  pool.destroy();
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  return {
    // f32 angles at positions up to a few thousand: a few 1e-4 absolute (the RoPE kernel's tolerance).
    q: maxToleranceRatio(actualQ, expected.q, 2e-3, 1e-3),
    // f16 storage: half an f16 step (2^-11 relative) on top of that.
    pages: maxToleranceRatio(stored, wanted, 2e-3, 2e-3),
  };
}

const base: Case = {
  layout: 'normal',
  heads: 8,
  kvHeads: 2,
  headDim: 64,
  ropeDim: 64,
  position: 9,
  headNorm: false,
  rotation: 'none',
};

describe('rope-append kernel (RoPE, rotation and the KV store of a decode step)', () => {
  it.each<[string, Partial<Case>]>([
    ['Llama (normal layout), f16 cache', {}],
    ['Llama, Hadamard rotations', { rotation: 'hadamard', position: 14 }],
    ['Llama, calibrated rotations per KV head', { rotation: 'calibrated', position: 1001, heads: 32, kvHeads: 8 }],
    ['Qwen2 (neox), partial rotary dims, f16 cache', { layout: 'neox', ropeDim: 32, position: 3 }],
    [
      'Qwen3 (head norms, neox, head size 128), calibrated',
      { layout: 'neox', headDim: 128, ropeDim: 128, headNorm: true, rotation: 'calibrated', position: 4000 },
    ],
    ['Qwen3 head norms, f16 cache, one KV head', { layout: 'neox', headNorm: true, kvHeads: 1, heads: 4, position: 0 }],
    [
      'head size 256, calibrated',
      { headDim: 256, ropeDim: 256, heads: 4, kvHeads: 2, rotation: 'calibrated', position: 6 },
    ],
  ])('matches the reference: %s', async (_, change) => {
    const { q, pages } = await runCase(ctx.gpu, { ...base, ...change });
    expect(q).toBeLessThanOrEqual(1);
    expect(pages).toBeLessThanOrEqual(1);
  });

  it("catches broken kernels: q heads rotated by another head's matrix (their own index's), k stored at the values", async () => {
    const wrongMatrix = mutateShaders(ctx.gpu, {
      label: 'rope-append-rotated-prefetched',
      edit: (code) => code.replace('if (isQ) { m = head / params.groupHeads; }', ''),
    });
    const calibrated: Case = { ...base, rotation: 'calibrated', heads: 8, kvHeads: 2 };
    expect((await runCase(wrongMatrix.gpu, calibrated)).q).toBeGreaterThan(1);
    expect(wrongMatrix.mutated).toEqual(['rope-append-rotated-prefetched']);
    const swapped = mutateShaders(ctx.gpu, {
      label: 'rope-append',
      edit: (code) => code.replace('first += params.kOffset', 'first += params.vOffset'),
    });
    expect((await runCase(swapped.gpu, base)).pages).toBeGreaterThan(1);
    expect(swapped.mutated).toEqual(['rope-append']);
  });

  it('fits a device by its storage bindings: 9 to 13, against the WebGPU default of 8', () => {
    const { gpu } = ctx;
    const eight = withLimits(gpu, { maxStorageBuffersPerShaderStage: 8 });
    const eleven = withLimits(gpu, { maxStorageBuffersPerShaderStage: 11 });
    expect(ropeAppendFits(eight, { headNorm: false, rotate: false }, 64)).toBe(false);
    expect(ropeAppendFits(eleven, { headNorm: false, rotate: true }, 64)).toBe(true);
    expect(ropeAppendFits(eleven, { headNorm: true, rotate: true }, 128)).toBe(false);
    expect(ropeAppendFits(gpu, { headNorm: true, rotate: true }, 512)).toBe(false);
  });
});
