import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { ATTENTION_PLANS_DOC, renderAttentionPlans } from './attention-plans.ts';

describe('docs/attention-plans.md', () => {
  const rendered = renderAttentionPlans();

  it('is what the runtime planner gives today (regenerate: npx tsx tools/attention-plans.ts)', () => {
    expect(readFileSync(ATTENTION_PLANS_DOC, 'utf8')).toBe(rendered);
  });

  it('plans the int8 tensor-core prefill only where the adapter has them, and the split kernel where nothing else fits', () => {
    const [h200, lavapipe, defaults] = rendered.replace(/ +/g, ' ').split('\n## ').slice(1);
    expect(h200).toMatch(/\| llama-3\.2-1b .* \| int2 \| prefill 1024 \| prefill-int8 \|/);
    expect(lavapipe).not.toContain('prefill-int8');
    expect(lavapipe).toMatch(/\| llama-3\.2-1b .* \| int2 \| prefill 1024 \| prefill \|/);
    // 16 KiB of workgroup storage holds no f32 prefill tile of headDim 128.
    expect(defaults).toMatch(/\| qwen3-4b .* \| f16 \| prefill 1024 \| split \|/);
    for (const table of [h200, lavapipe, defaults])
      expect(table).toMatch(/\| int2 \| decode \| decode \| .* \| merge \|/);
    // Qwen2.5-0.5B's 2-bit decode build in passes of 256 keys needs more than 16 KiB: there it takes passes of 128
    // rather than the split kernel.
    expect(h200).toMatch(/\| qwen2\.5-0\.5b .* \| int2 \| decode \| decode \| `attention-decode-hd64-r7-keys256-/);
    expect(defaults).toMatch(/\| qwen2\.5-0\.5b .* \| int2 \| decode \| decode \| `attention-decode-hd64-r7-keys128-/);
  });
});
