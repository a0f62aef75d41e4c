/**
 * A model whose chat template cannot render a short conversation within the template limits is refused when it
 * loads (UnsupportedModelError, every GPU buffer released), and the engine loads the next model and answers.
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { withChatTemplate } from '../../test/chat-templates.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { describeRefusal, faultLog, isRefusal, rejectionOf } from '../../test/regressions/fault-log.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';
const log = faultLog('template-load');

describe('chat template limits at load', () => {
  it('refuses a model whose template loops past its limits, frees what it loaded, then loads the demo model', async () => {
    const hostile = new Blob([
      await withChatTemplate(new Uint8Array(readFileSync(DEMO)), '{% for i in range(2147483647) %}x{% endfor %}'),
    ]);
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const baseline = ctx.gpu.allocator.snapshot();
    const refusal = await rejectionOf(engine.load(hostile, { kv: 'f16', kvBudgetBytes: 4 << 20 }));
    const message = /range\(\) of 2147483647 items/;
    const buffersLeft = ctx.gpu.allocator.snapshot().totalBuffers - baseline.totalBuffers;
    log.record({
      area: 'model load',
      fault: 'the demo model with a chat template that loops over range(2147483647), loaded with engine.load',
      expected: 'UnsupportedModelError naming the limit; every GPU buffer of the load released',
      outcome: `${describeRefusal(refusal, message)}; ${buffersLeft} buffers left`,
      ok: isRefusal(refusal, UnsupportedModelError, message) && buffersLeft === 0,
    });
    expect(refusal).toBeInstanceOf(UnsupportedModelError);
    expect((refusal as Error).message).toMatch(message);
    expect(buffersLeft).toBe(0);
    await engine.load(DEMO, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    const reply = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3 });
    const content = reply.choices[0].message.content ?? '';
    log.record({
      area: 'model load',
      fault: 'the demo model itself, next, on the same engine',
      expected: 'loads and answers a chat request',
      outcome: content.length > 0 ? `loaded; replied ${content.length} characters` : 'loaded; empty reply',
      ok: content.length > 0,
    });
    expect(content.length).toBeGreaterThan(0);
    engine.destroy();
  }, 120_000);
});
