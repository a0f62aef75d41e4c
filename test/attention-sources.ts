/**
 * Whole-kernel replacements for the attention kernels, for the tests of the tests and the bench's variants: the
 * kernels take no source parameter, so a replacement compiles on a view of the device whose modules of the matching
 * labels are replaced (mutateShaders, test/shader-mutation.ts).
 */
import type { GpuContext } from '../core/gpu/device.ts';
import { mutateShaders, type ShaderMutation } from './shader-mutation.ts';

/**
 * Replacement WGSL by kernel; `partial` must be built for the binding's blockKeys, headDim and >= its rows,
 * `decode` for its decode shape, `prefill` for its prefill shape (attentionPrefillShapeFor).
 */
export interface AttentionSources {
  partial?: string;
  decode?: string;
  prefill?: string;
  /** The int8 prefill kernel's WGSL (attention-prefill-int8.wgsl.ts, or -dot for 'int8-dot'), for a binding that runs it. */
  prefillInt8?: string;
  /** The int8 keys conversion pass's WGSL (attentionKeysInt8Source), for a binding the converted build serves. */
  keysInt8?: string;
  /**
   * The merge pass's WGSL: in place of attentionMergeRowsSource where a prefill binding takes the rows merge (its grid
   * stays the rows merge's), else of attentionMergeSource.
   */
  merge?: string;
}

/** The pipeline labels each replacement stands in for (the labels planAttentionKernel and prepareAttention give). */
const LABELS: Record<keyof AttentionSources, RegExp> = {
  partial: /^attention-(partial|mixed)-/,
  decode: /^attention-decode-/,
  prefill: /^attention-prefill-hd/,
  prefillInt8: /^attention-prefill-(int8|dot)-/,
  keysInt8: /^attention-keys-int8-/,
  merge: /^attention-merge/,
};

/** `gpu`, or a view of it on which the attention kernels `sources` names compile from their replacements. */
export function withAttentionSources(gpu: GpuContext, sources: AttentionSources | null | undefined): GpuContext {
  const mutations: ShaderMutation[] = [];
  for (const [field, code] of Object.entries(sources ?? {}) as [keyof AttentionSources, string | undefined][]) {
    // A replacement may equal the build it replaces (a variant that is some shape's own build).
    if (code !== undefined) mutations.push({ label: LABELS[field], edit: () => code, mayKeep: true });
  }
  return mutations.length > 0 ? mutateShaders(gpu, ...mutations).gpu : gpu;
}
