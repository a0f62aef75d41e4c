import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { loadStoriesModel } from '../../test/stories-model.ts';
import { PagedKvAttention } from '../kv/paged-attention.ts';
import { Transformer } from '../model/transformer.ts';
import { GREEDY_SAMPLING } from '../sampling/params.ts';
import { StepRunner } from './step-runner.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);

/** Counts queue submits and the bytes of every mapAsync while `run` runs. */
async function counting<T>(gpu: typeof ctx.gpu, run: () => Promise<T>) {
  const queue = gpu.device.queue;
  const submit = queue.submit.bind(queue);
  const proto = GPUBuffer.prototype as { mapAsync: GPUBuffer['mapAsync'] };
  const mapAsync = proto.mapAsync;
  const counts = { submits: 0, mappedBytes: [] as number[] };
  queue.submit = (buffers) => {
    counts.submits++;
    submit(buffers);
  };
  proto.mapAsync = function (this: GPUBuffer, mode: number, offset?: number, size?: number) {
    counts.mappedBytes.push(size ?? this.size - (offset ?? 0));
    return mapAsync.call(this, mode, offset, size);
  };
  try {
    return { result: await run(), counts };
  } finally {
    delete (queue as { submit?: unknown }).submit;
    if (queue.submit !== submit) queue.submit = submit;
    proto.mapAsync = mapAsync;
  }
}

describe.skipIf(!modelPath || !goldenPath)('StepRunner (stories260K)', () => {
  it('decodes the golden ids at one submit and one 4-byte readback per token, and releases what it made', async () => {
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const [bos, ...expected] = golden.greedy_ids;
    const steps = 24;
    const gpu = ctx.gpu;
    const baseline = gpu.allocator.snapshot().totalBuffers;
    const model = await loadStoriesModel(gpu, modelPath!);
    const { config, weights, pool } = model;
    const transformer = new Transformer(gpu, config, weights, new PagedKvAttention(gpu, pool, config), 1);
    const runner = new StepRunner(gpu, { pool, transformer, sampling: { label: 'test' } });
    const seq = pool.createSequence();
    try {
      pool.reserve(seq, steps + 1);
      runner.resetSamplerHistory([bos]);
      const sample = (step: number) => ({ params: GREEDY_SAMPLING, step });
      const first = await runner.submit({ seq, position: 0, ids: [bos], sample: sample(0) });
      const { result: rest, counts } = await counting(gpu, async () => {
        const ids: number[] = [];
        // Each decode step feeds the previous step's id from the GPU: no id goes up.
        for (let position = 1; position < steps; position++) {
          ids.push(await (runner.submit({ seq, position, ids: null, sample: sample(position) }) as Promise<number>));
        }
        return ids;
      });
      expect([first, ...rest]).toEqual(expected.slice(0, steps));
      expect(counts.submits).toBe(steps - 1);
      expect(counts.mappedBytes).toEqual(new Array(steps - 1).fill(4));
      // A step without sampling returns nothing to wait on; a runner without sampling cannot decode from the GPU id.
      expect(runner.submit({ seq, position: steps, ids: [bos] })).toBeNull();
      const plain = new StepRunner(gpu, { pool, transformer });
      expect(() => plain.submit({ seq, position: steps, ids: null })).toThrow(RangeError);
      expect(() => plain.submit({ seq, position: steps, ids: [bos], sample: sample(0) })).toThrow(RangeError);
      await gpu.device.queue.onSubmittedWorkDone();
    } finally {
      pool.free(seq);
      runner.release();
      transformer.release();
      await model.release();
    }
    expect(gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });
});
