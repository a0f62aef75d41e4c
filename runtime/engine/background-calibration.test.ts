/**
 * Background calibration of the KV rotations (LongtabEngine, in-process on Dawn, stories260K, int2 cache): a load
 * with rotation 'calibrated' and an empty cache starts on Hadamard, serves requests while the calibration runs
 * between them, caches the result under the model's digest and switches; the next load finds it in the cache.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { decodeRotations, modelDigest } from '../kv/rotation-store.ts';
import { readModelConfig } from '../model/config.ts';
import { type EngineLoadOptions, type EngineStats, LongtabEngine } from './api.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);

const CALIBRATION_TOKENS = 256;
/** stories260K: 5 layers, 4 KV heads × 8 dims (rows of 32 values); sink and window small so 2-bit pages are read. */
const INT2 = {
  kv: 'int2',
  kvBudgetBytes: 1 << 20,
  experimental: { sink: 16, window: 16, groupSize: 32 },
} as const satisfies EngineLoadOptions;
const CALIBRATED: EngineLoadOptions = {
  ...INT2,
  rotation: 'calibrated',
  experimental: { ...INT2.experimental, calibrationTokens: CALIBRATION_TOKENS },
};
const REQUEST = { prompt: 'Once upon a time', max_tokens: 64, temperature: 0 } as const;

function engineWithCache(dir: string): LongtabEngine {
  return new LongtabEngine({ gpu: ctx.gpu, openPath: sourceFromPath, rotationCache: nodeRotationCache(dir) });
}

async function until(engine: LongtabEngine, test: (s: EngineStats) => boolean, what: string): Promise<EngineStats> {
  const deadline = performance.now() + 240_000;
  for (;;) {
    const stats = await engine.stats();
    if (test(stats)) return stats;
    if (stats.kv.calibration?.phase === 'failed') throw new Error(`calibration failed: ${stats.kv.calibration.error}`);
    if (performance.now() > deadline) throw new Error(`timed out waiting for ${what}: ${JSON.stringify(stats.kv)}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

describe.skipIf(!modelPath)('background KV calibration (stories260K, int2)', () => {
  it('starts on Hadamard, serves requests meanwhile, caches by digest, switches; the next load uses the cache', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'longtab-bgcal-'));
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;

    const reference = engineWithCache(dir);
    await reference.load(modelPath!, { ...INT2, rotation: 'hadamard' });
    expect((await reference.stats()).kv).toMatchObject({ rotation: 'hadamard', calibration: null });
    const hadamard = (await reference.completions.create(REQUEST)).choices[0].text;
    reference.destroy();

    const engine = engineWithCache(dir);
    const phases: string[] = [];
    await engine.subscribeStats((s) => {
      const phase = s.kv.calibration?.phase;
      if (phase && phases.at(-1) !== phase) phases.push(phase);
    });
    await engine.load(modelPath!, CALIBRATED);
    const first = await engine.stats();
    expect(first.kv.rotation).toMatch(/^calibrating \d+%$/);
    expect(first.kv.clip).toEqual({ key: 1, value: 1 });

    // A request that starts while the calibration runs is served with the Hadamard rotation, unchanged.
    const running = await until(engine, (s) => (s.kv.calibration?.progress ?? 0) > 0.05, 'calibration progress');
    expect(running.kv.rotation).toMatch(/^calibrating/);
    const during = await engine.completions.create(REQUEST);
    expect(during.choices[0].text).toBe(hadamard);
    const conversation = await engine.chat.completions.create({
      messages: [{ role: 'user', content: 'Tell me about Lily.' }],
      conversation_id: 'c1',
      max_tokens: 8,
      temperature: 0,
    });
    expect(conversation.choices[0].finish_reason).toBeDefined();

    const done = await until(engine, (s) => s.kv.rotation === 'calibrated', 'the switch');
    expect(done.kv.calibration).toMatchObject({ phase: 'done', progress: 1, tokens: CALIBRATION_TOKENS });
    // It paused for the requests and resumed between them.
    expect(phases).toContain('paused');
    expect(phases.indexOf('generating')).toBeLessThan(phases.lastIndexOf('done'));
    // The conversation's KV (written with Hadamard) was dropped at the switch.
    expect(done.kv.sequences).toBe(0);
    const clip = done.kv.clip!;
    for (const q of [clip.key, clip.value]) expect([1, 0.98, 0.96, 0.94, 0.92, 0.9]).toContain(q);

    // The cache holds the result under the model's digest.
    const source = await sourceFromPath(modelPath!);
    const file = await parseGguf(source);
    const digest = await modelDigest(file, source);
    await source.close?.();
    const bytes = await nodeRotationCache(dir).get(digest);
    expect(bytes).toBeDefined();
    const stored = decodeRotations(bytes!, readModelConfig(file));
    expect(stored.tokens).toBe(CALIBRATION_TOKENS);
    expect(stored.clip!.key).toBeCloseTo(clip.key, 6);
    expect(stored.clip!.value).toBeCloseTo(clip.value, 6);
    const after = (await engine.completions.create(REQUEST)).choices[0].text;
    const followUp = await engine.chat.completions.create({
      messages: [
        { role: 'user', content: 'Tell me about Lily.' },
        { role: 'assistant', content: conversation.choices[0].message.content },
        { role: 'user', content: 'And then?' },
      ],
      conversation_id: 'c1',
      max_tokens: 4,
      temperature: 0,
    });
    // Re-prefilled in full: nothing of its Hadamard-era KV is reused.
    expect(followUp.usage.prompt_tokens_details.cached_tokens).toBe(0);
    await engine.unload();
    engine.destroy();

    // A second load finds the rotations in the cache: calibrated at once, no calibration, same replies.
    const again = engineWithCache(dir);
    await again.load(modelPath!, CALIBRATED);
    const loaded = await again.stats();
    expect(loaded.kv.rotation).toBe('calibrated');
    expect(loaded.kv.calibration).toBeNull();
    expect(loaded.kv.clip!.key).toBeCloseTo(clip.key, 6);
    expect((await again.completions.create(REQUEST)).choices[0].text).toBe(after);
    again.destroy();
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
  });

  it("unload stops a running calibration and releases its memory; calibrate: 'off' keeps the load error", async () => {
    const dir = mkdtempSync(join(tmpdir(), 'longtab-bgcal-'));
    const baseline = ctx.gpu.allocator.snapshot().totalBuffers;
    const engine = engineWithCache(dir);
    await engine.load(modelPath!, CALIBRATED);
    await until(engine, (s) => (s.kv.calibration?.progress ?? 0) > 0.05, 'calibration progress');
    await engine.unload();
    expect((await engine.stats()).memory.total).toBe(0);
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline);
    await expect(engine.load(modelPath!, { ...INT2, rotation: 'calibrated', calibrate: 'off' })).rejects.toThrow(
      /longtab calibrate/,
    );
    engine.destroy();
  });
});
