/**
 * Deliberately broken kernels for the tests of the tests ("a broken kernel must fail the comparison") and the bench
 * harnesses' edited builds, without a source parameter in any kernel's signature: the kernel is prepared on a view of
 * the GpuContext whose device compiles edited code for the pipelines a mutation names (test/shader-hooks.ts).
 *
 *   const broken = mutateShaders(gpu, { label: 'rmsnorm', edit: (c) => c.replace('f32(params.dim)', 'f32(0u)') });
 *   prepareRmsNorm(broken.gpu, ...);       // compiled from the edited code
 *   expect(broken.mutated).toEqual(['rmsnorm']);
 */
import type { GpuContext } from '../core/gpu/device.ts';
import { withShaderHooks } from './shader-hooks.ts';

export interface ShaderMutation {
  /** The pipelines it edits: the label their kernel gives computePipeline (core/gpu/dispatch.ts), or a pattern. */
  label: string | RegExp;
  /**
   * The edit of a module's WGSL. It must change every module it is given (else compiling throws): an edit that no
   * longer matches would test, or time, the real kernel.
   */
  edit(code: string): string;
  /** The edit may return a module unchanged: a harness's rebuild of the kernel, one of whose builds is the default. */
  mayKeep?: boolean;
}

export interface MutatedGpu {
  /** The view to prepare the kernel on: same device, allocator and errors as the original. */
  readonly gpu: GpuContext;
  /** The label of each module compiled from changed code, in order: proof the mutation is what ran. */
  readonly mutated: readonly string[];
}

const matches = (pattern: string | RegExp, label: string) =>
  typeof pattern === 'string' ? pattern === label : pattern.test(label);

/** A view of `gpu` whose modules of the mutations' labels compile from edited code (the first matching mutation's). */
export function mutateShaders(gpu: GpuContext, ...mutations: ShaderMutation[]): MutatedGpu {
  const mutated: string[] = [];
  const view = withShaderHooks(gpu, {
    code(label, code) {
      const mutation = mutations.find((m) => matches(m.label, label));
      if (!mutation) return code;
      const edited = mutation.edit(code);
      if (edited !== code) mutated.push(label);
      else if (!mutation.mayKeep) {
        throw new Error(`the mutation of '${label}' did not change its code: it no longer matches the kernel`);
      }
      return edited;
    },
  });
  return { gpu: view, mutated };
}
