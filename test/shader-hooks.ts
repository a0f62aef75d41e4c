/**
 * A view of a GpuContext (the same device underneath, the same allocator and error list) whose device passes every
 * shader module and compute pipeline it creates through hooks: how tests compile a mutated kernel
 * (test/shader-mutation.ts) and how tools/wgsl-dump.ts records what the runtime compiles, with no hook in any product
 * signature. No vitest import: bench harnesses and tools use it too.
 *
 * core/gpu/dispatch.ts caches pipelines per device object and code; the view's device is its own object, so every
 * pipeline made through a view is compiled afresh, through its hooks, even where the real device already holds it.
 */
import type { GpuContext } from '../core/gpu/device.ts';

/** What a compute pipeline was made from. */
export interface CompiledPipeline {
  /** The label computePipeline gave it (`'probe'` for a compile probe, kernels/matmul-int8.ts pipelineCompiles). */
  label: string;
  /** The WGSL its module compiled (after the `code` hook). */
  code: string;
  entryPoint: string;
}

export interface ShaderHooks {
  /** The code to compile for a module of this label; by default the code it was given. */
  code?(label: string, code: string): string;
  /** Called with each compute pipeline the view's device creates. */
  pipeline?(pipeline: GPUComputePipeline, made: CompiledPipeline): void;
}

/** `gpu` with its device's shader modules and compute pipelines passed through `hooks`. */
export function withShaderHooks(gpu: GpuContext, hooks: ShaderHooks): GpuContext {
  const codeOf = new WeakMap<GPUShaderModule, string>();
  const createShaderModule = (real: GPUDevice, d: GPUShaderModuleDescriptor): GPUShaderModule => {
    const code = hooks.code ? hooks.code(d.label ?? '', d.code) : d.code;
    const module = real.createShaderModule({ ...d, code });
    codeOf.set(module, code);
    return module;
  };
  const createComputePipeline = (real: GPUDevice, d: GPUComputePipelineDescriptor): GPUComputePipeline => {
    const pipeline = real.createComputePipeline(d);
    const code = codeOf.get(d.compute.module);
    if (code === undefined) throw new Error(`pipeline '${d.label}': its shader module was not made by this view`);
    hooks.pipeline?.(pipeline, { label: d.label ?? '', code, entryPoint: d.compute.entryPoint ?? 'main' });
    return pipeline;
  };
  const device = new Proxy(gpu.device, {
    get(real, property) {
      if (property === 'createShaderModule') return (d: GPUShaderModuleDescriptor) => createShaderModule(real, d);
      if (property === 'createComputePipeline') {
        return (d: GPUComputePipelineDescriptor) => createComputePipeline(real, d);
      }
      // The device's own methods and getters need the real device as `this` (Dawn's and browsers' native objects).
      const value = Reflect.get(real, property, real);
      return typeof value === 'function' ? value.bind(real) : value;
    },
  });
  return Object.assign(Object.create(gpu) as GpuContext, { device });
}
