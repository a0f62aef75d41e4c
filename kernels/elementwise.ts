import type { GpuContext } from '../core/gpu/device.ts';
import {
  bindBuffers,
  computePipeline,
  linearInvocationGrid,
  type PreparedDispatch,
  uniformBuffer,
} from '../core/gpu/dispatch.ts';
import { addInPlaceWgsl, type GatedActivation, gatedWgsl } from './elementwise.wgsl.ts';

/** out = silu(gate) * up over `count` f32 values, or gelu(gate) * up with `activation` 'geglu'. */
export function prepareSwiglu(
  gpu: GpuContext,
  label: string,
  b: { gate: GPUBuffer; up: GPUBuffer; output: GPUBuffer; count: number; activation?: GatedActivation },
): PreparedDispatch {
  const activation = b.activation ?? 'swiglu';
  const pipeline = computePipeline(gpu, activation, gatedWgsl(activation));
  const params = uniformBuffer(gpu, `${label}.params`, [b.count, 0, 0, 0], 'uuuu');
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.gate, b.up, b.output, params]),
    workgroups: linearInvocationGrid(b.count, 64),
    owned: [params],
  };
}

/** x += y over `count` f32 values. */
export function prepareAddInPlace(
  gpu: GpuContext,
  label: string,
  b: { x: GPUBuffer; y: GPUBuffer; count: number },
): PreparedDispatch {
  const pipeline = computePipeline(gpu, 'add', addInPlaceWgsl);
  const params = uniformBuffer(gpu, `${label}.params`, [b.count, 0, 0, 0], 'uuuu');
  return {
    label,
    pipeline,
    bindGroup: bindBuffers(gpu, label, pipeline, [b.x, b.y, params]),
    workgroups: linearInvocationGrid(b.count, 64),
    owned: [params],
  };
}
