/**
 * Heads of 256 dims (Falcon3's llama files; issue 43, point 3) in decode, on both caches: the greedy reply of the f16
 * cache and of the 2-bit cache (whose rotated output the merge pass's wide build un-rotates) is, token by token, the
 * exact CPU reference's choice. llama-oracle.test.ts holds the same shapes' prefill against llama.cpp.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { referenceLogProbs } from '../../test/model-reference.ts';
import { type ModelFixtureSpec, writeModelFixture } from '../../tools/fixtures/model-fixtures.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';

const ctx = withTestGpu();

/** Falcon3-1B's shape in small: heads × 256 = dim, 2:1 GQA, its RoPE base. */
const falcon3Style: ModelFixtureSpec = {
  architecture: 'llama',
  weightType: GgmlType.F32,
  dim: 1024,
  layers: 2,
  heads: 4,
  kvHeads: 2,
  headDim: 256,
  ffnDim: 512,
  vocab: 300,
  tiedOutput: false,
  ropeFreqBase: 1000042,
  llama3RopeFreqs: false,
  seed: 256,
};
const PROMPT = [1, 17, 200, 45, 99, 3];
/** A reference margin above which the engine's choice must be the reference's (f32 against f64 arithmetic). */
const MARGIN = 0.05;

describe('heads of 256 dims decode as the exact reference', () => {
  let dir: string;
  let path: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'longtab-wide-heads-'));
    path = await writeModelFixture(falcon3Style, dir);
  });
  afterAll(async () => {
    if (dir) await rm(dir, { recursive: true });
  });

  it.each(['f16', 'int2'] as const)('%s cache: every greedy token is the reference’s choice', async (kv) => {
    const runner = new ModelRunner(ctx.gpu);
    const source = await sourceFromPath(path);
    let ids: number[];
    try {
      await runner.load(source, { kv, kvBudgetBytes: 1 << 22 });
      ({ ids } = await runner.generate({ promptIds: PROMPT, maxTokens: 20, stopAtEog: false }));
    } finally {
      runner.unload();
      await source.close?.();
    }
    const sequence = [...PROMPT, ...ids];
    const exact = await referenceLogProbs(path, sequence, { emulateLlamaCpp: false });
    const vocab = falcon3Style.vocab;
    let checked = 0;
    for (let i = 0; i < ids.length; i++) {
      const row = exact.subarray((PROMPT.length - 1 + i) * vocab, (PROMPT.length + i) * vocab);
      const order = [...row.keys()].sort((a, b) => row[b] - row[a]);
      if (row[order[0]] - row[order[1]] <= MARGIN) continue;
      checked++;
      expect(ids[i], `token ${i}`).toBe(order[0]);
    }
    expect(checked).toBeGreaterThan(15);
  });
});
