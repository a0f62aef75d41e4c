import type { GpuContext } from './device.ts';

/** A dispatch with everything bound: recorded into a compute pass without any allocation. */
export interface PreparedDispatch {
  label: string;
  pipeline: GPUComputePipeline;
  bindGroup: GPUBindGroup;
  workgroups: readonly [number, number, number];
  /** Buffers created for this dispatch alone (its parameters); released with it. */
  owned: GPUBuffer[];
  /**
   * True when the step being encoded leaves this dispatch nothing to do (known on the host, e.g. a KV demotion on a
   * step that demotes no page): encodeDispatches leaves it out, saving its dispatch gap.
   */
  idle?: () => boolean;
}

export function releaseDispatches(gpu: GpuContext, dispatches: readonly PreparedDispatch[]): void {
  for (const d of dispatches) for (const b of d.owned) gpu.allocator.release(b);
}

/**
 * The dispatches `prepare` pushes into the list it is given; if it throws (a kernel refusing a shape), those prepared
 * so far are released first, so a failed graph leaves no buffer behind.
 */
export function prepareAllOrNone(gpu: GpuContext, prepare: (made: PreparedDispatch[]) => void): PreparedDispatch[] {
  const made: PreparedDispatch[] = [];
  try {
    prepare(made);
  } catch (error) {
    releaseDispatches(gpu, made);
    throw error;
  }
  return made;
}

const pipelineCache = new WeakMap<GPUDevice, Map<string, GPUComputePipeline>>();

/** Compiles a WGSL compute shader once per device and code string. */
export function computePipeline(gpu: GpuContext, label: string, code: string, entryPoint = 'main'): GPUComputePipeline {
  let cache = pipelineCache.get(gpu.device);
  if (!cache) pipelineCache.set(gpu.device, (cache = new Map()));
  const key = `${entryPoint}\u0000${code}`;
  let pipeline = cache.get(key);
  if (!pipeline) {
    const module = gpu.device.createShaderModule({ label, code });
    pipeline = gpu.device.createComputePipeline({ label, layout: 'auto', compute: { module, entryPoint } });
    cache.set(key, pipeline);
  }
  return pipeline;
}

/** Binds buffers to @group(0) at bindings 0..n-1, in order. */
export function bindBuffers(
  gpu: GpuContext,
  label: string,
  pipeline: GPUComputePipeline,
  buffers: readonly GPUBuffer[],
): GPUBindGroup {
  return gpu.device.createBindGroup({
    label,
    layout: pipeline.getBindGroupLayout(0),
    entries: buffers.map((buffer, binding) => ({ binding, resource: { buffer } })),
  });
}

/** A small uniform buffer of u32/f32 parameters, counted as scratch. */
export function uniformBuffer(gpu: GpuContext, label: string, words: ArrayLike<number>, kinds: string): GPUBuffer {
  const data = new ArrayBuffer(Math.max(16, Math.ceil((words.length * 4) / 16) * 16));
  const view = new DataView(data);
  for (let i = 0; i < words.length; i++) {
    if (kinds[i] === 'f') view.setFloat32(i * 4, words[i], true);
    else if (kinds[i] === 'i') view.setInt32(i * 4, words[i], true);
    else view.setUint32(i * 4, words[i], true);
  }
  const buffer = gpu.allocator.createBuffer({
    label,
    category: 'scratch',
    size: data.byteLength,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  gpu.device.queue.writeBuffer(buffer, 0, data);
  return buffer;
}

export function encodeDispatches(pass: GPUComputePassEncoder, dispatches: readonly PreparedDispatch[]): void {
  for (const d of dispatches) {
    if (d.idle?.()) continue;
    pass.setPipeline(d.pipeline);
    pass.setBindGroup(0, d.bindGroup);
    pass.dispatchWorkgroups(d.workgroups[0], d.workgroups[1], d.workgroups[2]);
  }
}

/** Records dispatches in one compute pass and submits them. */
export function submitDispatches(gpu: GpuContext, label: string, dispatches: readonly PreparedDispatch[]): void {
  const encoder = gpu.device.createCommandEncoder({ label });
  const pass = encoder.beginComputePass({ label });
  encodeDispatches(pass, dispatches);
  pass.end();
  gpu.device.queue.submit([encoder.finish()]);
}

/**
 * Workgroups for `invocations` threads in one dimension, folded into y past 65535 groups. Kernels using it index
 * their thread as `gid.x + gid.y * 65535u * WG` (WG = workgroupSize) and return past the end.
 */
export function linearInvocationGrid(invocations: number, workgroupSize: number): [number, number, number] {
  const groups = Math.ceil(invocations / workgroupSize);
  if (groups <= 65535) return [Math.max(groups, 1), 1, 1];
  return [65535, Math.ceil(groups / 65535), 1];
}
