import { describe, expect, it } from 'vitest';
import {
  describePlan,
  f16Positions,
  type KvPrecisionPlan,
  planEffectiveBits,
  planQuantBits,
  uniformPlan,
  validatePlan,
} from './precision-plan.ts';
import { defaultGroupSize } from './quant-format.ts';

import { quantPageLayout } from './quant-layout.ts';

const twoBit = { bits: 2, clipQuantile: 1 } as const;

describe('KV precision plans', () => {
  it("a plan's bits per element are what its quant pages allocate, for head_dim 64 and 128 and every mix", () => {
    const plans: Array<{ shape: { layers: number; kvHeads: number; headDim: number }; plan: KvPrecisionPlan }> = [
      { shape: { layers: 8, kvHeads: 2, headDim: 64 }, plan: uniformPlan(8, twoBit, twoBit) },
      {
        shape: { layers: 8, kvHeads: 2, headDim: 64 },
        plan: uniformPlan(8, twoBit, { bits: 2, clipQuantile: 0.96 }).map((l, i) =>
          i === 5
            ? { key: { bits: 4, clipQuantile: 1 }, value: l.value }
            : i % 3 === 0
              ? { key: l.key, value: { bits: 1, clipQuantile: 1 } }
              : l,
        ),
      },
      {
        shape: { layers: 6, kvHeads: 1, headDim: 128 },
        plan: uniformPlan(6, { bits: 4, clipQuantile: 1 }, { bits: 1, clipQuantile: 1 }),
      },
    ];
    for (const { shape, plan } of plans) {
      const width = shape.kvHeads * shape.headDim;
      const groupSize = defaultGroupSize(shape.kvHeads, shape.headDim);
      const layout = quantPageLayout({ ...shape, pageTokens: 16, keyFormat: { groupSize }, plan });
      const elements = 16 * shape.layers * 2 * width;
      expect((layout.pageWords * 32) / elements).toBeCloseTo(planQuantBits(plan, groupSize), 12);
      expect(layout.plan).toEqual(plan);
      for (let l = 0; l < shape.layers; l++) {
        expect(layout.rows(l, 0).format).toMatchObject({
          bits: plan[l].key.bits,
          clipQuantile: plan[l].key.clipQuantile,
        });
        expect(layout.rows(l, 1).format).toMatchObject({
          bits: plan[l].value.bits,
          clipQuantile: plan[l].value.clipQuantile,
        });
      }
    }
  });

  it('effective bits count the f16 sink, window and the page being filled: 2.39 at 32K for 2-bit rows of group 128', () => {
    const share = { sink: 64, window: 256, pageTokens: 16 };
    expect(f16Positions(share, 32768)).toBe(336);
    // The Llama-3.2-1B bench shape: 4,897 bytes a token at 32K (16 layers × 8 KV heads × 64 × 2 sides).
    const bits = planEffectiveBits(uniformPlan(16, twoBit, twoBit), 128, share, 32768);
    expect((bits * 16 * 8 * 64 * 2) / 8).toBeCloseTo(4896.75, 1);
    expect(f16Positions(share, 100)).toBe(100);
  });

  it('boostLayers and a plan do not mix; a damaged plan is refused with the layer and field named', () => {
    const shape = { layers: 2, kvHeads: 2, headDim: 64, pageTokens: 16 };
    expect(() => quantPageLayout({ ...shape, boostLayers: [1], plan: uniformPlan(2, twoBit, twoBit) })).toThrow(
      /drop boostLayers/,
    );
    expect(validatePlan(uniformPlan(3, twoBit, twoBit), 2)).toMatch(/one entry per layer \(2\)/);
    expect(validatePlan([{ key: { bits: 3, clipQuantile: 1 }, value: twoBit }], 1)).toMatch(/layer 0 key: bits/);
    expect(validatePlan([{ key: twoBit, value: { bits: 2, clipQuantile: 0.4 } }], 1)).toMatch(/layer 0 value: clip/);
    expect(() => quantPageLayout({ ...shape, plan: [{ key: twoBit, value: twoBit }] })).toThrow(/KV precision plan/);
  });

  it('describePlan names the common format and the layers that differ', () => {
    const plan = uniformPlan(4, twoBit, { bits: 2, clipQuantile: 0.96 });
    plan[2] = { key: { bits: 4, clipQuantile: 1 }, value: { bits: 1, clipQuantile: 1 } };
    expect(describePlan(plan)).toBe('K 2-bit, V 2-bit clip 0.96; layer 2: K 4-bit, V 1-bit');
  });
});
