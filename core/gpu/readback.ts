import type { GpuContext } from './device.ts';

/**
 * Copies `byteLength` bytes of a GPU buffer back to the CPU. Tests, calibration and the sampled token id use this;
 * the decode loop reads back nothing else.
 */
export async function readBuffer(
  gpu: GpuContext,
  source: GPUBuffer,
  byteLength: number,
  sourceOffset = 0,
): Promise<ArrayBuffer> {
  const size = Math.ceil(byteLength / 4) * 4;
  const staging = gpu.allocator.createBuffer({
    label: `readback:${source.label}`,
    category: 'staging',
    size,
    usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
  });
  try {
    const encoder = gpu.device.createCommandEncoder({ label: 'readback' });
    encoder.copyBufferToBuffer(source, sourceOffset, staging, 0, size);
    gpu.device.queue.submit([encoder.finish()]);
    await staging.mapAsync(GPUMapMode.READ);
    const copy = staging.getMappedRange(0, size).slice(0, byteLength);
    staging.unmap();
    return copy;
  } finally {
    gpu.allocator.release(staging);
  }
}

export async function readFloat32(
  gpu: GpuContext,
  source: GPUBuffer,
  count: number,
  offsetElements = 0,
): Promise<Float32Array> {
  return new Float32Array(await readBuffer(gpu, source, count * 4, offsetElements * 4));
}

export async function readUint32(
  gpu: GpuContext,
  source: GPUBuffer,
  count: number,
  offsetElements = 0,
): Promise<Uint32Array> {
  return new Uint32Array(await readBuffer(gpu, source, count * 4, offsetElements * 4));
}
