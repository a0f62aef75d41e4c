/**
 * Constrained decode queues each step's forward before the id that feeds it is read back, and draws once the host has
 * built the next mask (ModelRunner's decode loop, StepRunner.submitDraw). Checked on the demo model against the
 * teacher-forced logits of the same ids: every greedy draw is allowed by the mask a fresh constraint gives for its
 * prefix, and is the best allowed id there (within the tolerance between the decode and prefill graphs). A draw from
 * the previous step's mask or logits fails this; so does a look-ahead forward left in the cache.
 */
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { ResponseFormatCompiler, type TokenConstraint } from '../grammar/constraint.ts';
import type { ResponseFormat } from './api-types.ts';
import { ModelRunner } from './model-runner.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';
/** Greedy's pick may trail the best allowed logit of the prefill graph by this much (f32 kernels, other order). */
const TIE_TOLERANCE = 2e-3;

/** Formats that run to max_tokens on the demo model, and one that ends by itself (its stop token drawn). */
const FORMATS: ResponseFormat[] = [
  { type: 'json_object' },
  {
    type: 'json_schema',
    json_schema: {
      name: 'book',
      schema: {
        type: 'object',
        properties: { book: { enum: ['Genesis', 'Exodus'] } },
        required: ['book'],
        additionalProperties: false,
      },
    },
  },
  {
    type: 'json_schema',
    json_schema: {
      name: 'verse',
      schema: {
        type: 'object',
        properties: { book: { enum: ['Genesis', 'Exodus'] }, chapter: { type: 'integer' }, text: { type: 'string' } },
        required: ['book', 'chapter', 'text'],
      },
    },
  },
];

const allows = (mask: Uint32Array, id: number) => ((mask[id >>> 5] >>> (id & 31)) & 1) === 1;

describe('constrained decode with the forward queued ahead (demo model)', () => {
  it.each(['f16', 'int2'] as const)(
    'kv %s: each greedy draw is the best id its prefix mask allows; the cache holds exactly the reply',
    async (kv) => {
      const runner = new ModelRunner(ctx.gpu);
      const source = await sourceFromPath(DEMO);
      let compiler: ResponseFormatCompiler | null = null;
      const constraints: TokenConstraint[] = [];
      const fresh = async (format: ResponseFormat) => {
        const c = await (compiler as ResponseFormatCompiler).constraint(format);
        if (!c) throw new Error('a text format has no constraint');
        constraints.push(c);
        return c;
      };
      try {
        const config = await runner.load(source, {
          kv,
          kvBudgetBytes: 8 << 20,
          ...(kv === 'int2' ? { rotation: 'hadamard' as const } : {}),
        });
        compiler = await ResponseFormatCompiler.create(runner.tokenizer.grammarVocabulary(config.vocab));
        const prompt = runner.tokenizer.encode('And the LORD said unto Moses, write this:', { addSpecial: true });
        for (const format of FORMATS) {
          const seq = runner.pool.createSequence();
          try {
            const result = await runner.generateInSequence(seq, {
              promptIds: prompt,
              maxTokens: 40,
              sampling: { temperature: 0 },
              stopAtEog: true,
              constraint: await fresh(format),
            });
            const ids = result.ids;
            expect(ids.length).toBeGreaterThan(4);
            expect(result.finishReason).toBe(
              format.type === 'json_schema' && format.json_schema.name === 'book' ? 'stop' : 'length',
            );
            // The look-ahead forward of the last token is truncated away: the cache holds prompt + reply − 1.
            expect(seq.length).toBe(prompt.length + ids.length - 1);
            const logits = await runner.teacherForcedLogits([...prompt, ...ids.slice(0, -1)]);
            const replay = await fresh(format);
            for (let t = 0; t < ids.length; t++) {
              const mask = await replay.nextMask();
              const row = logits.subarray((prompt.length - 1 + t) * config.vocab, (prompt.length + t) * config.vocab);
              let best = Number.NEGATIVE_INFINITY;
              for (let id = 0; id < config.vocab; id++) if (allows(mask, id) && row[id] > best) best = row[id];
              expect(allows(mask, ids[t]), `step ${t}: id ${ids[t]} is not allowed`).toBe(true);
              expect(best - row[ids[t]], `step ${t}: id ${ids[t]} is not the best allowed`).toBeLessThanOrEqual(
                TIE_TOLERANCE,
              );
              replay.accept(ids[t]);
            }
          } finally {
            runner.pool.free(seq);
          }
        }
      } finally {
        for (const c of constraints) c.dispose();
        compiler?.dispose();
        runner.unload();
        await source.close?.();
      }
    },
    180_000,
  );
});
