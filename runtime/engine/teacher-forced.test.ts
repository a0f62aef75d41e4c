import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

describe.skipIf(!modelPath)('teacher-forced logits of selected rows (stories260K)', () => {
  it('fills the chunks that hold a requested row exactly as a full read does, and leaves the other chunks zero', async () => {
    const engine = new ModelRunner(ctx.gpu);
    const source = await sourceFromPath(modelPath as string);
    try {
      // Chunks of 16: rows 0-15, 16-31, 32-47, 48-59.
      const config = await engine.load(source, { kv: 'f16', prefillChunk: 16 });
      const vocab = config.vocab;
      const story = 'Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ';
      const ids = engine.tokenizer.encode(story.repeat(3), { addSpecial: true }).slice(0, 60);
      expect(ids.length).toBe(60);
      const full = await engine.teacherForcedLogits(ids);
      const wanted = new Set([3, 50]);
      const some = await engine.teacherForcedLogits(ids, (row) => wanted.has(row));
      const row = (logits: Float32Array, t: number) => logits.subarray(t * vocab, (t + 1) * vocab);
      const read = (t: number) => t < 16 || t >= 48; // the chunks of rows 3 and 50
      for (let t = 0; t < ids.length; t++) {
        if (read(t)) expect(row(some, t), `row ${t}`).toEqual(row(full, t));
        else
          expect(
            row(some, t).every((x) => x === 0),
            `row ${t} left zero`,
          ).toBe(true);
      }
      // The rows it read are real logits, and the skipped chunks still filled the cache the later rows attend to.
      expect(row(full, 50).some((x) => x !== 0)).toBe(true);
    } finally {
      engine.unload();
      await source.close?.();
    }
  });
});
