import { GpuOutOfMemoryError } from '../errors.ts';
import type { GpuLimits } from './limits.ts';

/** What a buffer holds; the memory panel, the API stats and the tests read these counts. */
export type MemoryCategory = 'weights' | 'kv' | 'scratch' | 'staging';
export const MEMORY_CATEGORIES: readonly MemoryCategory[] = ['weights', 'kv', 'scratch', 'staging'];

export interface MemorySnapshot {
  bytes: Record<MemoryCategory, number>;
  buffers: Record<MemoryCategory, number>;
  totalBytes: number;
  totalBuffers: number;
  peakBytes: number;
}

export interface BufferRequest {
  label: string;
  category: MemoryCategory;
  size: number;
  usage: GPUBufferUsageFlags;
  mappedAtCreation?: boolean;
}

function zeroCounts(): Record<MemoryCategory, number> {
  return { weights: 0, kv: 0, scratch: 0, staging: 0 };
}

/** Rounds a size up to the 4-byte multiple WebGPU requires of buffers written with writeBuffer. */
export function alignTo(size: number, alignment: number): number {
  return Math.ceil(size / alignment) * alignment;
}

/**
 * The one place GPU buffers are created. Every buffer is labelled and counted by category, so memory reporting
 * is exact (no WebGPU API reports memory) and leaks show up as counts that do not return to their baseline.
 */
export class GpuAllocator {
  private readonly device: GPUDevice;
  private readonly limits: GpuLimits;
  private readonly live = new Map<GPUBuffer, { category: MemoryCategory; size: number }>();
  private readonly bytes = zeroCounts();
  private readonly buffers = zeroCounts();
  private peak = 0;

  constructor(device: GPUDevice, limits: GpuLimits) {
    this.device = device;
    this.limits = limits;
  }

  createBuffer(request: BufferRequest): GPUBuffer {
    const size = alignTo(Math.max(request.size, 4), 4);
    if (size > this.limits.maxBufferSize) {
      throw new GpuOutOfMemoryError(
        `Buffer '${request.label}' needs ${size} bytes but this GPU allows at most ${this.limits.maxBufferSize} per buffer.`,
        { label: request.label, size, maxBufferSize: this.limits.maxBufferSize },
      );
    }
    const buffer = this.device.createBuffer({
      label: `${request.category}:${request.label}`,
      size,
      usage: request.usage,
      mappedAtCreation: request.mappedAtCreation ?? false,
    });
    this.live.set(buffer, { category: request.category, size });
    this.bytes[request.category] += size;
    this.buffers[request.category] += 1;
    this.peak = Math.max(this.peak, this.totalBytes());
    return buffer;
  }

  /** A storage buffer filled with `data` (copy-dst so it can be rewritten later). */
  createStorage(label: string, category: MemoryCategory, data: ArrayBufferView | number, extraUsage = 0): GPUBuffer {
    const size = typeof data === 'number' ? data : data.byteLength;
    const buffer = this.createBuffer({
      label,
      category,
      size,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC | extraUsage,
    });
    if (typeof data !== 'number')
      this.device.queue.writeBuffer(buffer, 0, data.buffer, data.byteOffset, data.byteLength);
    return buffer;
  }

  release(buffer: GPUBuffer): void {
    const entry = this.live.get(buffer);
    if (!entry) return;
    this.live.delete(buffer);
    this.bytes[entry.category] -= entry.size;
    this.buffers[entry.category] -= 1;
    buffer.destroy();
  }

  releaseAll(): void {
    for (const buffer of [...this.live.keys()]) this.release(buffer);
  }

  totalBytes(): number {
    let total = 0;
    for (const c of MEMORY_CATEGORIES) total += this.bytes[c];
    return total;
  }

  snapshot(): MemorySnapshot {
    let totalBuffers = 0;
    for (const c of MEMORY_CATEGORIES) totalBuffers += this.buffers[c];
    return {
      bytes: { ...this.bytes },
      buffers: { ...this.buffers },
      totalBytes: this.totalBytes(),
      totalBuffers,
      peakBytes: this.peak,
    };
  }
}
