/**
 * A precision plan of the 2-bit cache: per layer, the code bits and clip quantile of its demoted K rows and of its V
 * rows (the group size is the pool's). Calibration chooses one by what each choice costs the model's own loss, under
 * a bit budget (runtime/calibration/precision-search.ts); the pool lays its quant pages out by it
 * (runtime/kv/quant-layout.ts); it is stored with the rotations (runtime/kv/rotation-store.ts) and shown in
 * `stats().kv.plan`.
 */
import { InvalidRequestError } from '../../core/errors.ts';

/** The format of one side (K or V) of one layer's quantized rows. */
export interface KvSidePrecision {
  bits: 1 | 2 | 4;
  /** In (0.5, 1]; 1 = plain min/max (runtime/kv/quant-format.ts). */
  clipQuantile: number;
}

export interface KvLayerPrecision {
  key: KvSidePrecision;
  value: KvSidePrecision;
}

/** One entry per layer. */
export type KvPrecisionPlan = readonly KvLayerPrecision[];

/** The same K and V formats in every layer. */
export function uniformPlan(layers: number, key: KvSidePrecision, value: KvSidePrecision): KvLayerPrecision[] {
  return Array.from({ length: layers }, () => ({ key: { ...key }, value: { ...value } }));
}

/** Checks a plan read from storage or passed in: one entry per layer, known bits, clips in (0.5, 1]. */
export function validatePlan(plan: unknown, layers: number): string | null {
  if (!Array.isArray(plan) || plan.length !== layers) return `a plan needs one entry per layer (${layers})`;
  for (const [l, entry] of plan.entries()) {
    for (const side of ['key', 'value'] as const) {
      const p = (entry as Partial<KvLayerPrecision> | null)?.[side];
      if (!p || ![1, 2, 4].includes(p.bits)) return `layer ${l} ${side}: bits must be 1, 2 or 4`;
      if (!(typeof p.clipQuantile === 'number' && p.clipQuantile > 0.5 && p.clipQuantile <= 1)) {
        return `layer ${l} ${side}: clip quantile must be in (0.5, 1]`;
      }
    }
  }
  return null;
}

export function assertPlan(plan: unknown, layers: number): asserts plan is KvPrecisionPlan {
  const problem = validatePlan(plan, layers);
  if (problem) throw new InvalidRequestError(`KV precision plan: ${problem}.`, { option: 'plan' });
}

/** Bits per element of the plan's quantized rows, scales included (bits + 32 / groupSize per side, averaged). */
export function planQuantBits(plan: KvPrecisionPlan, groupSize: number): number {
  let sum = 0;
  for (const layer of plan) sum += layer.key.bits + layer.value.bits;
  return sum / (2 * plan.length) + 32 / groupSize;
}

/** The pool's f16 share: sink pages, the window, and the page being filled. */
export interface KvF16Share {
  sink: number;
  window: number;
  pageTokens: number;
}

/** Positions a sequence of `tokens` keeps in f16 pages (sink rounded up to pages, window, the page being filled). */
export function f16Positions(share: KvF16Share, tokens: number): number {
  const sink = Math.ceil(share.sink / share.pageTokens) * share.pageTokens;
  return Math.min(tokens, sink + share.window + share.pageTokens);
}

/** Effective bits per element of a sequence of `tokens` positions under the plan: f16 share, codes and scales. */
export function planEffectiveBits(plan: KvPrecisionPlan, groupSize: number, share: KvF16Share, tokens: number): number {
  const f16 = f16Positions(share, tokens);
  return (f16 * 16 + (tokens - f16) * planQuantBits(plan, groupSize)) / tokens;
}

function side(p: KvSidePrecision): string {
  return p.clipQuantile < 1 ? `${p.bits}-bit clip ${p.clipQuantile}` : `${p.bits}-bit`;
}

/**
 * One line a person can read: the most common layer format, then the layers that differ, e.g.
 * "K 2-bit clip 0.94, V 2-bit clip 0.94; layer 5: K 4-bit, V 2-bit".
 */
export function describePlan(plan: KvPrecisionPlan): string {
  const text = (l: KvLayerPrecision) => `K ${side(l.key)}, V ${side(l.value)}`;
  const counts = new Map<string, number>();
  for (const l of plan) counts.set(text(l), (counts.get(text(l)) ?? 0) + 1);
  let common = '';
  for (const [t, n] of counts) if (common === '' || n > (counts.get(common) ?? 0)) common = t;
  const others = plan.flatMap((l, i) => (text(l) === common ? [] : [`layer ${i}: ${text(l)}`]));
  return [common, ...others].join('; ');
}
