/**
 * Device loss (issue 9): a separate Dawn device is destroyed from inside the token callback, or from the load's
 * progress callback while the model loads. The engine must report a typed DeviceLostError that says what to do, a
 * failed load must leave no GPU buffer behind, and a fresh engine on a new device loads the model again and, given the
 * same conversation messages, re-prefills and continues exactly as a run that was never interrupted.
 */
import { readFileSync } from 'node:fs';
import { afterAll, describe, expect, it } from 'vitest';
import { DeviceLostError } from '../../core/errors.ts';
import { acquireGpu, type GpuContext } from '../../core/gpu/device.ts';
import { nodeGpu } from '../../core/gpu/node.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeError, faultLog } from '../../test/regressions/fault-log.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import type { ChatCompletionChunk, ChatMessageParam } from './api.ts';
import { type LoadProgress, ModelRunner } from './model-runner.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);
const log = faultLog('device-loss');

/** Devices this file acquires besides the shared one; each test loses or releases its own. */
const extra: GpuContext[] = [];
async function separateDevice(): Promise<GpuContext> {
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  extra.push(gpu);
  return gpu;
}
afterAll(() => {
  for (const gpu of extra) if (!gpu.isLost) gpu.destroy();
});

const SYSTEM: ChatMessageParam = { role: 'system', content: 'You tell short stories about Lily and her red ball.' };

describe.skipIf(!modelPath || !goldenPath)('device loss on stories260K', () => {
  it('ModelRunner.generate: device.destroy() after 3 tokens rejects with DeviceLostError; a new device continues the golden ids', async () => {
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const gpu = await separateDevice();
    const engine = new ModelRunner(gpu);
    const source = await sourceFromPath(modelPath!);
    await engine.load(source, { kvBudgetBytes: 4 << 20 });
    const seen: number[] = [];
    const bos = golden.greedy_ids[0];
    let failure: unknown = null;
    try {
      await engine.generate({
        promptIds: [bos],
        maxTokens: 64,
        stopAtEog: false,
        onToken: (id) => {
          seen.push(id);
          if (seen.length === 3) gpu.device.destroy();
          return undefined;
        },
      });
    } catch (error) {
      failure = error;
    }
    log.record({
      area: 'device',
      fault: 'GPUDevice.destroy() from onToken after 3 decoded tokens (ModelRunner.generate)',
      expected: 'DeviceLostError with an actionable message',
      outcome: failure ? describeError(failure) : 'resolved',
      ok: failure instanceof DeviceLostError,
    });
    expect(failure).toBeInstanceOf(DeviceLostError);
    expect((failure as DeviceLostError).code).toBe('device-lost');
    expect((failure as DeviceLostError).message).toMatch(/reload the model/i);
    // Decode queues one step ahead of the host: the step for token 4 may have finished and been read back before the
    // loss, and then it is delivered (it is a correct token). Nothing after it can be.
    expect(seen.length === 3 || seen.length === 4).toBe(true);
    expect(seen).toEqual(golden.greedy_ids.slice(1, 1 + seen.length));
    // A lost engine answers every later call with the same typed error instead of hanging or crashing.
    await expect(engine.generate({ promptIds: [bos], maxTokens: 4 })).rejects.toBeInstanceOf(DeviceLostError);

    const fresh = new ModelRunner(await separateDevice());
    await fresh.load(source, { kvBudgetBytes: 4 << 20 });
    const resumed = await fresh.generate({ promptIds: [bos, ...seen], maxTokens: 20, stopAtEog: false });
    expect(resumed.ids).toEqual(golden.greedy_ids.slice(1 + seen.length, 21 + seen.length));
    fresh.unload();
    await source.close?.();
  });

  // Each phase of a load, lost at its first progress event: before the GPU is used (parse), with part of the
  // weights uploaded (upload), and in the warm-up token (calibrate).
  it.each(['parse', 'upload', 'calibrate'] as const)(
    'ModelRunner.load: device.destroy() at the first %s progress event rejects with DeviceLostError, leaves no GPU buffer, and a new device loads and reproduces the golden ids',
    async (phase) => {
      const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
      const gpu = await separateDevice();
      const engine = new ModelRunner(gpu);
      const source = await sourceFromPath(modelPath!);
      let lostAt: LoadProgress | null = null;
      // Writes to a lost device are silently dropped, so the load checks for the loss at each upload progress step
      // (before that check it ran on to the warm-up readback: ~50 more events); the count shows how far it got.
      let eventsAfterLoss = 0;
      let failure: unknown = null;
      try {
        await engine.load(source, {
          kvBudgetBytes: 4 << 20,
          onProgress: (progress) => {
            if (lostAt) eventsAfterLoss += 1;
            if (lostAt || progress.phase !== phase) return;
            lostAt = progress;
            gpu.device.destroy();
          },
        });
      } catch (error) {
        failure = error;
      }
      const memory = gpu.allocator.snapshot();
      const loadedAfterLoss = engine.loaded !== null;
      // The lost device stays lost: loading on it again fails the same way instead of hanging.
      let again: unknown = null;
      await engine.load(source, { kvBudgetBytes: 4 << 20 }).catch((error: unknown) => {
        again = error;
      });

      const fresh = new ModelRunner(await separateDevice());
      await fresh.load(source, { kvBudgetBytes: 4 << 20 });
      const bos = golden.greedy_ids[0];
      const result = await fresh.generate({ promptIds: [bos], maxTokens: 24, stopAtEog: false });
      const goldenIds = result.ids.join(',') === golden.greedy_ids.slice(1, 25).join(',');
      log.record({
        area: 'device',
        fault: `GPUDevice.destroy() at the first '${phase}' progress event of ModelRunner.load; then a load on a new device`,
        expected: 'DeviceLostError; nothing loaded; 0 GPU buffers, 0 bytes left; golden ids on the new device',
        outcome:
          `${failure ? describeError(failure) : 'loaded'} after ${eventsAfterLoss} more progress events; ` +
          `${memory.totalBuffers} buffers, ${memory.totalBytes} bytes left; ` +
          `new device: ${goldenIds ? 'golden ids' : 'different ids'}`,
        ok:
          failure instanceof DeviceLostError &&
          !loadedAfterLoss &&
          memory.totalBuffers === 0 &&
          memory.totalBytes === 0 &&
          goldenIds,
      });
      expect(lostAt).not.toBeNull();
      expect(failure).toBeInstanceOf(DeviceLostError);
      // The upload stops at the loss instead of reading the rest of the file (it ran ~50 more events before).
      expect(eventsAfterLoss).toBeLessThanOrEqual(3);
      expect((failure as DeviceLostError).code).toBe('device-lost');
      expect((failure as DeviceLostError).message).toMatch(/reload the model/i);
      expect(loadedAfterLoss).toBe(false);
      expect(memory.buffers).toEqual({ weights: 0, kv: 0, scratch: 0, staging: 0 });
      expect(memory.totalBytes).toBe(0);
      expect(again).toBeInstanceOf(DeviceLostError);
      expect(gpu.allocator.snapshot().totalBuffers).toBe(0);
      expect(result.ids).toEqual(golden.greedy_ids.slice(1, 25));
      fresh.unload();
      expect(fresh.memory().totalBuffers).toBe(0);
      await source.close?.();
    },
  );

  it('chat API: the stream fails with DeviceLostError and a fresh engine on a new device continues the conversation', async () => {
    const turn1: ChatMessageParam[] = [SYSTEM, { role: 'user', content: 'Where did Lily go?' }];
    const request = { temperature: 0, max_tokens: 24, conversation_id: 'story' } as const;

    // Uninterrupted reference on the test's shared device.
    const reference = createNodeEngine({ gpu: ctx.gpu });
    await reference.load(modelPath!, { kvBudgetBytes: 4 << 20 });
    const r1 = (await reference.chat.completions.create({ ...request, messages: turn1 })).choices[0].message.content;
    const turn2: ChatMessageParam[] = [
      ...turn1,
      { role: 'assistant', content: r1 },
      { role: 'user', content: 'What happened next?' },
    ];
    const r2 =
      (await reference.chat.completions.create({ ...request, messages: turn2 })).choices[0].message.content ?? '';
    reference.destroy();

    // The same conversation on a device that is lost while the second reply streams.
    const doomed = await separateDevice();
    const engine = createNodeEngine({ gpu: doomed });
    await engine.load(modelPath!, { kvBudgetBytes: 4 << 20 });
    const a1 = (await engine.chat.completions.create({ ...request, messages: turn1 })).choices[0].message.content;
    expect(a1).toBe(r1);
    const stream = await engine.chat.completions.create({ ...request, messages: turn2, stream: true });
    const chunks: ChatCompletionChunk[] = [];
    let failure: unknown = null;
    try {
      for await (const chunk of stream) {
        chunks.push(chunk);
        if (chunks.length === 4) doomed.device.destroy();
      }
    } catch (error) {
      failure = error;
    }
    log.record({
      area: 'device',
      fault: 'GPUDevice.destroy() while a chat reply streams (LongtabEngine, conversation turn 2)',
      expected: 'the stream rejects with DeviceLostError; a new engine continues the conversation identically',
      outcome: failure ? describeError(failure) : 'stream ended normally',
      ok: failure instanceof DeviceLostError,
    });
    expect(failure).toBeInstanceOf(DeviceLostError);
    expect((failure as Error).message).toMatch(/conversation is kept/);
    const partial = chunks.map((c) => c.choices[0].delta.content ?? '').join('');
    expect(r2.startsWith(partial)).toBe(true);

    // The API keeps the messages, not the device: a fresh engine re-prefills them and gives the uninterrupted reply.
    const recovered = createNodeEngine({ gpu: await separateDevice() });
    await recovered.load(modelPath!, { kvBudgetBytes: 4 << 20 });
    const again = await recovered.chat.completions.create({ ...request, messages: turn2 });
    expect(again.choices[0].message.content).toBe(r2);
    expect(again.usage.prompt_tokens_details.cached_tokens).toBe(0);
    log.record({
      area: 'device',
      fault: 'reload on a new device after the loss, same conversation messages',
      expected: 'the same greedy reply as an uninterrupted run (re-prefilled, nothing cached)',
      outcome: again.choices[0].message.content === r2 ? 'identical reply' : 'different reply',
      ok: again.choices[0].message.content === r2,
    });
    recovered.destroy();
    engine.destroy();
  });
});
