/**
 * A model whose chat template cannot render a short conversation within the template limits is refused when it
 * loads (UnsupportedModelError, every GPU buffer released), and the engine loads the next model and answers.
 */
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { UnsupportedModelError } from '../../core/errors.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { parseGguf } from '../gguf/parse.ts';
import { sourceFromBytes } from '../gguf/sources.ts';
import { metadataEntriesOf, writeGguf } from '../gguf/writer.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';

describe('chat template limits at load', () => {
  it('refuses a model whose template loops past its limits, frees what it loaded, then loads the demo model', async () => {
    const bytes = new Uint8Array(readFileSync(DEMO));
    const file = await parseGguf(sourceFromBytes(bytes));
    const metadata = metadataEntriesOf(file).map((e) =>
      e.key === 'tokenizer.chat_template' ? { ...e, value: '{% for i in range(2147483647) %}x{% endfor %}' } : e,
    );
    const tensors = file.tensors.map((t) => ({
      name: t.name,
      shape: t.shape,
      type: t.type,
      data: bytes.subarray(t.offset, t.offset + t.byteLength),
    }));
    const hostile = new Blob([writeGguf({ metadata, tensors, alignment: file.alignment })]);
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
