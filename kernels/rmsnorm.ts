import type { GpuContext } from '../runtime/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from './dispatch.ts';
import { rmsnormInPlaceWgsl, rmsnormWgsl } from './rmsnorm.wgsl.ts';

export interface RmsNormBinding {
  input: GPUBuffer;
  weight: GPUBuffer;
  output: GPUBuffer;
  rows: number;
  dim: number;
  eps: number;
}

/** Prepares an RMSNorm dispatch over `rows` rows of `dim` f32 values; `output` may be `input` (in place). */
export function prepareRmsNorm(gpu: GpuContext, label: string, b: RmsNormBinding, source?: string): PreparedDispatch {
  const inPlace = b.input === b.output;
  const pipeline = computePipeline(
    gpu,
    inPlace ? 'rmsnorm-in-place' : 'rmsnorm',
    source ?? (inPlace ? rmsnormInPlaceWgsl : rmsnormWgsl),
  );
  const params = uniformBuffer(gpu, `${label}.params`, [b.rows, b.dim, b.eps, 0], 'uufu');
  // WebGPU forbids binding one buffer as both read-only and read-write storage in a dispatch.
  const bindGroup = inPlace
    ? gpu.device.createBindGroup({
        label,
        layout: pipeline.getBindGroupLayout(0),
        entries: [
          { binding: 0, resource: { buffer: b.input } },
          { binding: 1, resource: { buffer: b.weight } },
          { binding: 3, resource: { buffer: params } },
        ],
      })
    : bindBuffers(gpu, label, pipeline, [b.input, b.weight, b.output, params]);
  return {
    label,
    pipeline,
    bindGroup,
    workgroups: [b.rows, 1, 1],
    owned: [params],
  };
}
