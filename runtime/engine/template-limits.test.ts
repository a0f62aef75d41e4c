/**
 * A model whose chat template cannot render a short conversation within the template limits is refused when it
 * loads (UnsupportedModelError, every GPU buffer released), and the engine loads the next model and answers.
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { withChatTemplate } from '../../test/chat-templates.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';

describe('chat template limits at load', () => {
  it('refuses a model whose template loops past its limits, frees what it loaded, then loads the demo model', async () => {
    const hostile = new Blob([
      await withChatTemplate(new Uint8Array(readFileSync(DEMO)), '{% for i in range(2147483647) %}x{% endfor %}'),
    ]);
    const engine = createNodeEngine({ gpu: ctx.gpu });
    const baseline = ctx.gpu.allocator.snapshot();
    const load = engine.load(hostile, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    await expect(load).rejects.toBeInstanceOf(UnsupportedModelError);
    await expect(load).rejects.toThrow(/range\(\) of 2147483647 items/);
    expect(ctx.gpu.allocator.snapshot().totalBuffers).toBe(baseline.totalBuffers);
    await engine.load(DEMO, { kv: 'f16', kvBudgetBytes: 4 << 20 });
    const reply = await engine.chat.completions.create({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3 });
    expect(reply.choices[0].message.content!.length).toBeGreaterThan(0);
    engine.destroy();
  }, 120_000);
});
