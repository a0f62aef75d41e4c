import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../core/errors.ts';
import type { GpuContext } from '../core/gpu/device.ts';
import { encodeDispatches } from '../core/gpu/dispatch.ts';
import { readUint32 } from '../core/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { argmaxReference, sampleReference } from './reference/sample.ts';
import { prepareSampler, type SamplerParams, samplingUniform, tokenMaskWords } from './sample.ts';
import type { sampleWgsl } from './sample.wgsl.ts';

const ctx = withTestGpu();

const GREEDY: SamplerParams = { temperature: 0, topK: 0, topP: 1, minP: 0, repetitionPenalty: 1, seed: 0 };

interface Run {
  logits: Float32Array;
  params: SamplerParams;
  history?: number[];
  /** One draw per step, in order; the history ring carries over between them as in decode. */
  steps: number[];
  historyCapacity?: number;
  /** A token mask for every step (Sampler.setMask). */
  mask?: Uint32Array;
}

/** Runs the sampler once per step (one submit each, as decode does) and returns the sampled ids. */
async function sampleOnGpu(
  gpu: GpuContext,
  run: Run,
): Promise<{ ids: number[]; history: Uint32Array; state: Uint32Array }> {
  const vocab = run.logits.length;
  const before = gpu.allocator.snapshot().totalBuffers;
  const logits = gpu.allocator.createStorage('logits', 'scratch', run.logits);
  const output = gpu.allocator.createStorage('sampled', 'scratch', 4);
  const results = gpu.allocator.createStorage('sampled-all', 'scratch', run.steps.length * 4);
  const sampler = prepareSampler(gpu, 'sample-test', {
    logits,
    vocab,
    output,
    historyCapacity: run.historyCapacity ?? 64,
  });
  sampler.resetHistory(run.history ?? []);
  if (run.mask) sampler.setMask(run.mask);
  run.steps.forEach((step, i) => {
    sampler.setParams(run.params, step);
    const encoder = gpu.device.createCommandEncoder({ label: 'sample-test' });
    const pass = encoder.beginComputePass({ label: 'sample-test' });
    encodeDispatches(pass, sampler.dispatches);
    pass.end();
    encoder.copyBufferToBuffer(output, 0, results, i * 4, 4);
    gpu.device.queue.submit([encoder.finish()]);
  });
  const ids = Array.from(await readUint32(gpu, results, run.steps.length));
  const owned = sampler.dispatches.flatMap((d) => d.owned);
  const history = await readUint32(gpu, owned.find((b) => b.label.endsWith('.history'))!, 1 + sampler.historyCapacity);
  // State after the last step (see State in sample.wgsl.ts): [maxLogit, argmax, done, prefix, needCount, needMass, kKey, pKey].
  const state = await readUint32(gpu, owned.find((b) => b.label.endsWith('.state'))!, 8);
  sampler.release();
  for (const b of [logits, output, results]) gpu.allocator.release(b);
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  return { ids, history, state };
}

describe('sampler: greedy', () => {
  it.each([512, 5000, 151936])('equals the CPU argmax on random logits, vocab %i', async (vocab) => {
    const random = seededRandom(vocab);
    const logits = randomFloats(random, vocab, 8);
    const { ids } = await sampleOnGpu(ctx.gpu, { logits, params: GREEDY, steps: [0] });
    expect(ids[0]).toBe(argmaxReference(logits));
  });

  it('breaks ties toward the lowest id, across workgroups', async () => {
    const logits = randomFloats(seededRandom(7), 9000, 1);
    for (const i of [8999, 5000, 4097, 333]) logits[i] = 5;
    const { ids } = await sampleOnGpu(ctx.gpu, { logits, params: GREEDY, steps: [0] });
    expect(ids[0]).toBe(333);
  });

  it('repetition penalty moves the argmax off a repeated token, and the sampler appends to the history', async () => {
    const logits = randomFloats(seededRandom(11), 512, 1);
    logits[100] = 3; // best
    logits[200] = 2.5; // second: wins once 100 is penalized by 1.3 (3 / 1.3 ≈ 2.31)
    logits[300] = -2.9;
    const params = { ...GREEDY, repetitionPenalty: 1.3 };
    const plain = await sampleOnGpu(ctx.gpu, { logits, params, steps: [0] });
    expect(plain.ids[0]).toBe(100);
    // 100 in the history: 200 wins; then 200 is appended too, so the third step picks 100 (2.31 > 2.5/1.3).
    const { ids, history } = await sampleOnGpu(ctx.gpu, {
      logits,
      params,
      history: [5, 100, 7],
      steps: [0, 1, 2],
      historyCapacity: 4,
    });
    expect(ids).toEqual([200, 100, 100]);
    // Ring of 4 after 6 ids [5, 100, 7, 200, 100, 100]: count 6, slots hold ids 4, 5, 2, 3.
    expect(Array.from(history)).toEqual([6, 100, 100, 7, 200]);
    const ref = sampleReference(logits, { ...params, topK: 0, topP: 1, minP: 0 }, [5, 100, 7], 0);
    expect(ref.choice).toBe(200);
  });

  it('a penalty below 1 boosts a negative logit as llama.cpp does (logit * penalty)', async () => {
    const logits = randomFloats(seededRandom(12), 512, 1);
    logits[10] = 2;
    logits[20] = 1.5; // 1.5 / 0.7 ≈ 2.14 > 2
    const { ids } = await sampleOnGpu(ctx.gpu, {
      logits,
      params: { ...GREEDY, repetitionPenalty: 0.7 },
      history: [20],
      steps: [0],
    });
    expect(ids[0]).toBe(20);
  });
});

function orderedKey(v: number): number {
  const bits = new Uint32Array(new Float32Array([v]).buffer)[0];
  if (bits === 0x80000000) return 0x80000000;
  return bits & 0x80000000 ? ~bits >>> 0 : (bits | 0x80000000) >>> 0;
}

/** The candidate set the GPU used: ids whose key reaches max(top-k key, top-p key, min-p key) from its state. */
function gpuCandidates(penalized: Float32Array, state: Uint32Array, minP: number): number[] {
  const maxLogit = new Float32Array(state.buffer, 0, 1)[0];
  let threshold = Math.max(state[6], state[7]);
  if (minP > 0) threshold = Math.max(threshold, orderedKey(Math.fround(maxLogit + Math.log(minP))));
  const kept: number[] = [];
  penalized.forEach((l, i) => {
    if (orderedKey(l) >= threshold) kept.push(i);
  });
  return kept;
}

function randomParams(random: () => number, vocab: number): SamplerParams {
  const pick = <T>(options: T[]): T => options[Math.floor(random() * options.length)];
  return {
    temperature: pick([0.3, 0.7, 1, 1.5]),
    topK: pick([0, 1, 5, 40, Math.floor(vocab / 3), vocab + 5]),
    topP: pick([1, 0.95, 0.9, 0.5, 0.1]),
    minP: pick([0, 0, 0.05, 0.2]),
    repetitionPenalty: pick([1, 1.1, 1.5, 0.8]),
    seed: Math.floor(random() * 1e9),
  };
}

describe('sampler: stochastic', () => {
  it('the same (seed, steps) reproduce the same sequence; another seed gives another', async () => {
    const logits = randomFloats(seededRandom(21), 2000, 3);
    const params: SamplerParams = {
      temperature: 1,
      topK: 50,
      topP: 0.95,
      minP: 0.01,
      repetitionPenalty: 1.1,
      seed: 42,
    };
    const steps = Array.from({ length: 24 }, (_, i) => i);
    const a = await sampleOnGpu(ctx.gpu, { logits, params, steps });
    const b = await sampleOnGpu(ctx.gpu, { logits, params, steps });
    const c = await sampleOnGpu(ctx.gpu, { logits, params: { ...params, seed: 43 }, steps });
    expect(b.ids).toEqual(a.ids);
    expect(c.ids).not.toEqual(a.ids);
    expect(new Set(a.ids).size).toBeGreaterThan(1);
  });

  // Several draws per case; the reference follows the GPU's history ring (capacity 64 > 20 + steps).
  it.each([
    [512, 40, 4],
    [5000, 10, 2],
  ])(
    'matches the reference candidates and choice for the same uniform number, vocab %i, %i cases x %i draws',
    async (vocab, cases, draws) => {
      const random = seededRandom(vocab + 99);
      let mismatches = 0;
      let excused = 0;
      let candidateSizes = 0;
      for (let c = 0; c < cases; c++) {
        const logits = randomFloats(random, vocab, 1 + random() * 6);
        // Some exact ties, so the tie rule at thresholds is exercised.
        for (let t = 0; t < 8; t++) logits[Math.floor(random() * vocab)] = logits[Math.floor(random() * vocab)];
        const params = randomParams(random, vocab);
        const history = Array.from({ length: 20 }, () => Math.floor(random() * vocab));
        const first = Math.floor(random() * 1000);
        const steps = Array.from({ length: draws }, (_, i) => first + i);
        const gpuRun = await sampleOnGpu(ctx.gpu, { logits, params, history, steps });
        const seen = [...history];
        steps.forEach((step, i) => {
          const ref = sampleReference(logits, params, seen, samplingUniform(params.seed, step));
          expect(ref.candidates).toContain(gpuRun.ids[i]);
          if (gpuRun.ids[i] !== ref.choice) {
            mismatches++;
            if (ref.nearBoundary) excused++;
          }
          if (i === draws - 1 && params.temperature > 0) {
            candidateSizes += ref.candidates.length;
            const kept = gpuCandidates(ref.penalized, gpuRun.state, params.minP);
            if (!ref.nearBoundary) expect(kept).toEqual(ref.candidates);
          }
          seen.push(gpuRun.ids[i]);
        });
      }
      expect(mismatches, 'mismatches not explained by f32 rounding at a boundary').toBe(excused);
      expect(mismatches).toBeLessThanOrEqual(Math.ceil((cases * draws) / 20));
      expect(candidateSizes).toBeGreaterThan(cases); // the filters left real choices, not only the argmax
    },
  );
});

describe('sampler: filters keep every id tied at a threshold', () => {
  // 10: 5, 11: 4, 12..15: 3 (tied), 16: 2, 17: 1, the other 506 ids: -5.
  const logits = new Float32Array(512).fill(-5);
  logits.set([5, 4, 3, 3, 3, 3, 2, 1], 10);
  const base: SamplerParams = { temperature: 1, topK: 0, topP: 1, minP: 0, repetitionPenalty: 1, seed: 3 };
  it.each<[string, Partial<SamplerParams>, number[]]>([
    ['top-k 3 keeps the four-way tie at the 3rd value', { topK: 3 }, [10, 11, 12, 13, 14, 15]],
    ['top-k >= vocab is off', { topK: 600, minP: 0.001 }, [10, 11, 12, 13, 14, 15, 16, 17]],
    ['top-p 0.7 crosses inside the tie and keeps all of it', { topP: 0.7 }, [10, 11, 12, 13, 14, 15]],
    ['top-p 0.4 keeps the argmax alone', { topP: 0.4 }, [10]],
    ['min-p 0.3 keeps logits >= max + ln 0.3', { minP: 0.3 }, [10, 11]],
    ['top-k 5 then top-p 0.99 (mass over the top-k survivors)', { topK: 5, topP: 0.99 }, [10, 11, 12, 13, 14, 15]],
  ])('%s', async (_, change, expected) => {
    const params = { ...base, ...change };
    const { ids, state } = await sampleOnGpu(ctx.gpu, { logits, params, steps: [0] });
    const ref = sampleReference(logits, params, [], samplingUniform(params.seed, 0));
    expect(ref.candidates).toEqual(expected);
    expect(gpuCandidates(ref.penalized, state, params.minP)).toEqual(expected);
    expect(ids[0]).toBe(ref.choice);
  });
});

describe('sampler: masked logits', () => {
  it('never draws a -Infinity logit, even when top-k reaches into them', async () => {
    const logits = randomFloats(seededRandom(31), 512, 2);
    logits.fill(Number.NEGATIVE_INFINITY, 100);
    const params: SamplerParams = { temperature: 1.3, topK: 200, topP: 0.98, minP: 0, repetitionPenalty: 1.1, seed: 9 };
    const steps = Array.from({ length: 16 }, (_, i) => i);
    const { ids } = await sampleOnGpu(ctx.gpu, { logits, params, steps, historyCapacity: 4 });
    const seen: number[] = [];
    steps.forEach((step, i) => {
      expect(ids[i]).toBeLessThan(100);
      expect(ids[i]).toBe(sampleReference(logits, params, seen.slice(-4), samplingUniform(params.seed, step)).choice);
      seen.push(ids[i]);
    });
  });
});

/** A random token mask over `vocab` ids allowing about `share` of them (at least one), and the logits it leaves. */
function randomMask(random: () => number, logits: Float32Array, share: number) {
  const mask = new Uint32Array(tokenMaskWords(logits.length));
  const allowed: number[] = [];
  logits.forEach((_, i) => {
    if (random() < share) allowed.push(i);
  });
  if (allowed.length === 0) allowed.push(Math.floor(random() * logits.length));
  for (const i of allowed) mask[i >>> 5] |= 1 << (i & 31);
  const masked = logits.map((l, i) => ((mask[i >>> 5] >>> (i & 31)) & 1 ? l : Number.NEGATIVE_INFINITY));
  return { mask, masked, allowed: new Set(allowed) };
}

describe('sampler: token mask', () => {
  it('draws only allowed ids, as the reference does on the logits with every other id at -Infinity', async () => {
    const random = seededRandom(41);
    for (let c = 0; c < 10; c++) {
      const vocab = [37, 512, 4099, 9000][c % 4];
      const logits = randomFloats(random, vocab, 3);
      const { mask, masked, allowed } = randomMask(random, logits, [0.002, 0.05, 0.5, 0.9][c % 4]);
      const params = { ...randomParams(random, vocab), ...(c % 3 === 0 ? { temperature: 0 } : {}) };
      // The history holds the best forbidden ids, so a penalty below 1 would lift them if the mask did not hold.
      const history = Array.from(logits.keys())
        .filter((i) => !allowed.has(i))
        .sort((a, b) => logits[b] - logits[a])
        .slice(0, 8);
      const steps = [c, c + 100];
      const { ids } = await sampleOnGpu(ctx.gpu, {
        logits,
        params: { ...params, repetitionPenalty: 0.8 },
        history,
        steps,
        mask,
      });
      const seen = history.slice();
      steps.forEach((step, i) => {
        expect(allowed.has(ids[i])).toBe(true);
        const ref = sampleReference(
          masked,
          { ...params, repetitionPenalty: 0.8 },
          seen.slice(-64),
          samplingUniform(params.seed, step),
        );
        if (!ref.nearBoundary) expect(ids[i]).toBe(ref.choice);
        seen.push(ids[i]);
      });
    }
  });

  it('null lifts the mask; a mask of the wrong size or with no allowed id is refused', async () => {
    const logits = randomFloats(seededRandom(42), 100, 3);
    const best = logits.indexOf(Math.max(...logits));
    const output = ctx.gpu.allocator.createStorage('sampled', 'scratch', 4);
    const buffer = ctx.gpu.allocator.createStorage('logits', 'scratch', logits);
    const sampler = prepareSampler(ctx.gpu, 'mask-test', { logits: buffer, vocab: 100, output });
    const run = async () => {
      sampler.setParams(GREEDY, 0);
      const encoder = ctx.gpu.device.createCommandEncoder();
      const pass = encoder.beginComputePass();
      encodeDispatches(pass, sampler.dispatches);
      pass.end();
      ctx.gpu.device.queue.submit([encoder.finish()]);
      return (await readUint32(ctx.gpu, output, 1))[0];
    };
    const other = (best + 1) % 100;
    const only = new Uint32Array(tokenMaskWords(100));
    only[other >>> 5] = 1 << (other & 31);
    sampler.setMask(only);
    expect(await run()).toBe(other);
    sampler.setMask(null);
    expect(await run()).toBe(best);
    expect(() => sampler.setMask(new Uint32Array(3))).toThrow(InvalidRequestError);
    // Bits past the vocabulary (ids 100..127 of the last word) allow nothing.
    const beyond = new Uint32Array(4);
    beyond[3] = 0xfffffff0;
    expect(() => sampler.setMask(beyond)).toThrow(/allows no token/);
    // A refused mask leaves the sampler as it was: unmasked.
    expect(await run()).toBe(best);
    sampler.release();
    ctx.gpu.allocator.release(output);
    ctx.gpu.allocator.release(buffer);
  });

  it('a copy pass that ignores the mask is caught', async () => {
    const broken = mutateShaders(ctx.gpu, {
      label: 'sample.copy',
      edit: (code) => code.replace('params.masked == 0u ||', 'true ||'),
    });
    const random = seededRandom(43);
    let outside = 0;
    for (let c = 0; c < 6; c++) {
      const logits = randomFloats(random, 512, 3);
      const { mask, allowed } = randomMask(random, logits, 0.1);
      const { ids } = await sampleOnGpu(broken.gpu, { logits, params: { ...GREEDY, seed: c }, steps: [c], mask });
      if (!allowed.has(ids[0])) outside++;
    }
    expect(broken.mutated).toEqual(['sample.copy']);
    expect(outside).toBeGreaterThan(3);
  });
});

describe('sampler: distribution', () => {
  it('a 151936 vocab with top-p alone (thousands of candidates, mass split over 38 workgroups) matches the reference', async () => {
    const vocab = 151936;
    const random = seededRandom(5);
    const logits = randomFloats(random, vocab, 4);
    const params: SamplerParams = { temperature: 0.9, topK: 0, topP: 0.6, minP: 0, repetitionPenalty: 1.2, seed: 7 };
    const history = [1, 2, 3, 150000];
    const { ids, state } = await sampleOnGpu(ctx.gpu, { logits, params, history, steps: [3] });
    const ref = sampleReference(logits, params, history, samplingUniform(params.seed, 3));
    expect(ref.candidates.length).toBeGreaterThan(1000);
    expect(gpuCandidates(ref.penalized, state, 0)).toEqual(ref.candidates);
    expect(ids[0]).toBe(ref.choice);
  });

  it('draw frequencies over 600 steps match the reference probabilities (chi-square)', async () => {
    const logits = Float32Array.from([2.1, 1.9, 1.9, 0.4, -0.3, 1.2, 0.8, -2, 0.1, 1.5, 0.9, -1, 0.3, 0.6, -0.5, 1.0]);
    const params: SamplerParams = {
      temperature: 0.8,
      topK: 10,
      topP: 0.9,
      minP: 0.05,
      repetitionPenalty: 1,
      seed: 1234,
    };
    const steps = Array.from({ length: 600 }, (_, i) => i);
    const { ids } = await sampleOnGpu(ctx.gpu, { logits, params, steps });
    const ref = sampleReference(logits, params, [], 0.5);
    expect(ref.candidates.length).toBeGreaterThan(4);
    // Step by step the draws are the reference's, given the same uniform numbers.
    const expectedIds = steps.map((s) => sampleReference(logits, params, [], samplingUniform(params.seed, s)).choice);
    expect(ids).toEqual(expectedIds);
    // And the hashed uniforms are uniform enough: chi-square against the candidate probabilities. The sequence is
    // deterministic, so the bound (df + 6·sqrt(2·df), far beyond the 0.1% critical value) cannot flake.
    const counts = new Map<number, number>();
    for (const id of ids) counts.set(id, (counts.get(id) ?? 0) + 1);
    for (const id of counts.keys()) expect(ref.candidates).toContain(id);
    let chi2 = 0;
    ref.candidates.forEach((id, j) => {
      const expected = ids.length * ref.probabilities[j];
      chi2 += ((counts.get(id) ?? 0) - expected) ** 2 / expected;
    });
    const df = ref.candidates.length - 1;
    expect(chi2).toBeLessThan(df + 6 * Math.sqrt(2 * df));
  });
});

describe('sampler: broken kernels are caught', () => {
  const filtered: Partial<SamplerParams> = { temperature: 0.4, topK: 30, topP: 0.95, repetitionPenalty: 1.8 };
  // Top-p alone over all 512 ids: bins hold more than one top weight of mass, so the 32.32 carries matter.
  const broad: Partial<SamplerParams> = { temperature: 1, topK: 0, topP: 0.3, repetitionPenalty: 1 };
  it.each<[string, keyof typeof sampleWgsl, string, string, Partial<SamplerParams>]>([
    ['the draw ignores the temperature', 'draw', 'exp((x - maxLogit) / temperature)', 'exp(x - maxLogit)', filtered],
    [
      'the select stops one bin early',
      'select',
      'cumCount + binCount[b] >= needCount',
      'cumCount >= needCount',
      filtered,
    ],
    ['the penalty divides negative logits', 'penalty', 'l > 0.0', 'l < 0.0', filtered],
    [
      'the mass histogram drops its carries',
      'histogram',
      'atomicAdd(&massHi[bin], 1u)',
      'atomicAdd(&massHi[bin], 0u)',
      broad,
    ],
  ])('%s', async (_, shader, from, to, change) => {
    const broken = mutateShaders(ctx.gpu, { label: `sample.${shader}`, edit: (code) => code.replace(from, to) });
    const random = seededRandom(404);
    let mismatches = 0;
    for (let c = 0; c < 12; c++) {
      const logits = randomFloats(random, 512, 3);
      const params: SamplerParams = { ...GREEDY, ...change, seed: c };
      // History = the 30 best ids, so the penalty reorders the top of the distribution.
      const history = Array.from(logits.keys())
        .sort((a, b) => logits[b] - logits[a])
        .slice(0, 30);
      const { ids } = await sampleOnGpu(broken.gpu, { logits, params, history, steps: [c] });
      if (ids[0] !== sampleReference(logits, params, history, samplingUniform(c, c)).choice) mismatches++;
    }
    // One module compiled from the edit, on the first run (the view caches it for the others).
    expect(broken.mutated).toEqual([`sample.${shader}`]);
    expect(mismatches).toBeGreaterThan(3);
  });
});
