import { describe, expect, it } from 'vitest';
import type { GpuContext } from '../runtime/gpu/device.ts';
import { readUint32 } from '../runtime/gpu/readback.ts';
import { withTestGpu } from '../test/gpu.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { encodeDispatches } from './dispatch.ts';
import { argmaxReference, sampleReference } from './reference/sample.ts';
import { prepareSampler, type SamplerParams, samplingUniform } from './sample.ts';
import { type SampleShaders, sampleWgsl } from './sample.wgsl.ts';

const ctx = withTestGpu();

const GREEDY: SamplerParams = { temperature: 0, topK: 0, topP: 1, minP: 0, repetitionPenalty: 1, seed: 0 };

interface Run {
  logits: Float32Array;
  params: SamplerParams;
  history?: number[];
  /** One draw per step, in order; the history ring carries over between them as in decode. */
  steps: number[];
  historyCapacity?: number;
  shaders?: SampleShaders;
}

/** Runs the sampler once per step (one submit each, as decode does) and returns the sampled ids. */
async function sampleOnGpu(gpu: GpuContext, run: Run): Promise<{ ids: number[]; history: Uint32Array }> {
  const vocab = run.logits.length;
  const before = gpu.allocator.snapshot().totalBuffers;
  const logits = gpu.allocator.createStorage('logits', 'scratch', run.logits);
  const output = gpu.allocator.createStorage('sampled', 'scratch', 4);
  const results = gpu.allocator.createStorage('sampled-all', 'scratch', run.steps.length * 4);
  const sampler = prepareSampler(
    gpu,
    'sample-test',
    { logits, vocab, output, historyCapacity: run.historyCapacity ?? 64 },
    run.shaders,
  );
  sampler.resetHistory(run.history ?? []);
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
  const historyBuffer = sampler.dispatches.flatMap((d) => d.owned).find((b) => b.label.endsWith('.history'))!;
  const history = await readUint32(gpu, historyBuffer, 1 + sampler.historyCapacity);
  sampler.release();
  for (const b of [logits, output, results]) gpu.allocator.release(b);
  expect(gpu.allocator.snapshot().totalBuffers).toBe(before);
  return { ids, history };
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
