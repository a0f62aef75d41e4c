import { DeviceLostError, GpuValidationError, WebGpuUnavailableError } from '../errors.ts';
import { GpuAllocator } from './allocator.ts';
import { type GpuLimits, REQUESTED_LIMITS } from './limits.ts';

/**
 * Optional features used as fast paths; nothing requires them. Subgroup matrices (tensor cores) are Dawn's
 * experimental feature: offered only with `allow_unsafe_apis` (Node: core/gpu/node.ts; Chrome:
 * --enable-unsafe-webgpu).
 */
const SUBGROUP_MATRIX = 'chromium-experimental-subgroup-matrix';
const OPTIONAL_FEATURES = ['shader-f16', 'subgroups', 'timestamp-query', SUBGROUP_MATRIX] as const;

export interface GpuFeatures {
  shaderF16: boolean;
  subgroups: boolean;
  timestampQuery: boolean;
  /**
   * i8 x i8 -> i32 subgroup matrices of 16x16x32 on subgroups of exactly 32 invocations: the int8 prefill matmul
   * (kernels/matmul-int8.ts) runs on them.
   */
  subgroupMatrixI8: boolean;
}

interface SubgroupMatrixConfig {
  componentType: string;
  resultComponentType: string;
  M: number;
  N: number;
  K: number;
}

function hasI8SubgroupMatrix(adapter: GPUAdapter, device: GPUDevice): boolean {
  if (!device.features.has(SUBGROUP_MATRIX)) return false;
  const info = adapter.info as GPUAdapterInfo & {
    subgroupMatrixConfigs?: readonly SubgroupMatrixConfig[];
    subgroupMinSize?: number;
    subgroupMaxSize?: number;
  };
  if (info.subgroupMinSize !== 32 || info.subgroupMaxSize !== 32) return false;
  return (info.subgroupMatrixConfigs ?? []).some(
    (c) => c.componentType === 'i8' && c.resultComponentType === 'i32' && c.M === 16 && c.N === 16 && c.K === 32,
  );
}

export interface AdapterSummary {
  vendor: string;
  architecture: string;
  device: string;
  description: string;
  isFallbackAdapter: boolean;
  subgroupMinSize?: number;
  subgroupMaxSize?: number;
}

export interface AcquireOptions {
  /** The GPU object: `navigator.gpu` in a page or worker, `nodeGpu()` in Node. Defaults to `navigator.gpu`. */
  gpu?: GPU;
  powerPreference?: GPUPowerPreference;
  /** Called for every uncaptured WebGPU error in addition to recording it. */
  onError?: (error: GpuValidationError) => void;
}

/**
 * One acquired device with everything the runtime needs to know about it. Uncaptured WebGPU errors are recorded
 * (and re-thrown by `throwIfErrors`) so that a validation error can never pass silently in a test or a generation.
 */
export class GpuContext {
  readonly device: GPUDevice;
  readonly adapter: AdapterSummary;
  readonly limits: GpuLimits;
  readonly features: GpuFeatures;
  readonly allocator: GpuAllocator;
  readonly errors: GpuValidationError[] = [];
  /** Resolves when the device is lost (destroyed, driver reset, out of memory). */
  readonly lost: Promise<DeviceLostError>;
  private lostError: DeviceLostError | null = null;

  constructor(
    device: GPUDevice,
    adapter: AdapterSummary,
    limits: GpuLimits,
    features: GpuFeatures,
    onError?: (e: GpuValidationError) => void,
  ) {
    this.device = device;
    this.adapter = adapter;
    this.limits = limits;
    this.features = features;
    this.allocator = new GpuAllocator(device, limits);
    device.addEventListener('uncapturederror', (event) => {
      const gpuError = (event as GPUUncapturedErrorEvent).error;
      const error = new GpuValidationError(`WebGPU ${gpuError.constructor.name}: ${gpuError.message}`);
      this.errors.push(error);
      onError?.(error);
    });
    this.lost = device.lost.then((info) => {
      this.lostError = new DeviceLostError(
        `The GPU device was lost (${info.reason}): ${info.message || 'no message'}. Reload the model to continue; the conversation is kept.`,
        { reason: info.reason },
      );
      return this.lostError;
    });
  }

  get isLost(): boolean {
    return this.lostError !== null;
  }

  /** Throws the first recorded uncaptured error (and clears the list), or the device-lost error. */
  throwIfErrors(): void {
    if (this.lostError) throw this.lostError;
    const first = this.errors[0];
    if (first) {
      this.errors.length = 0;
      throw first;
    }
  }

  destroy(): void {
    this.allocator.releaseAll();
    this.device.destroy();
  }
}

function summarizeAdapter(adapter: GPUAdapter): AdapterSummary {
  const info = adapter.info as GPUAdapterInfo & {
    subgroupMinSize?: number;
    subgroupMaxSize?: number;
    isFallbackAdapter?: boolean;
  };
  const summary: AdapterSummary = {
    vendor: info.vendor ?? '',
    architecture: info.architecture ?? '',
    device: info.device ?? '',
    description: info.description ?? '',
    isFallbackAdapter: Boolean(
      info.isFallbackAdapter ?? (adapter as { isFallbackAdapter?: boolean }).isFallbackAdapter,
    ),
  };
  if (info.subgroupMinSize !== undefined) summary.subgroupMinSize = info.subgroupMinSize;
  if (info.subgroupMaxSize !== undefined) summary.subgroupMaxSize = info.subgroupMaxSize;
  return summary;
}

/** Requests an adapter and a device with the adapter's real limits and the optional features it offers. */
export async function acquireGpu(options: AcquireOptions = {}): Promise<GpuContext> {
  const gpu = options.gpu ?? (typeof navigator !== 'undefined' ? navigator.gpu : undefined);
  if (!gpu) {
    throw new WebGpuUnavailableError(
      'WebGPU is not available here. Use Chrome or Edge 113+, Safari 26, or Firefox 141 on Windows (with WebGPU enabled).',
    );
  }
  const adapter = await gpu.requestAdapter(options.powerPreference ? { powerPreference: options.powerPreference } : {});
  if (!adapter) {
    throw new WebGpuUnavailableError(
      'WebGPU is present but no GPU adapter was found. Enable hardware acceleration in the browser settings, or check that the GPU driver is installed.',
    );
  }
  const requiredLimits: Record<string, number> = {};
  for (const name of REQUESTED_LIMITS) requiredLimits[name] = adapter.limits[name];
  const offered = OPTIONAL_FEATURES.filter((f) => adapter.features.has(f));
  // Subgroup matrices need subgroups on the device too.
  const requiredFeatures = offered.filter(
    (f) => f !== SUBGROUP_MATRIX || offered.includes('subgroups'),
  ) as GPUFeatureName[];
  const device = await adapter.requestDevice({ requiredLimits, requiredFeatures, label: 'longtab' });
  const limits = {} as GpuLimits;
  for (const name of REQUESTED_LIMITS) limits[name] = device.limits[name];
  const features: GpuFeatures = {
    shaderF16: device.features.has('shader-f16'),
    subgroups: device.features.has('subgroups'),
    timestampQuery: device.features.has('timestamp-query'),
    subgroupMatrixI8: device.features.has('subgroups') && hasI8SubgroupMatrix(adapter, device),
  };
  return new GpuContext(device, summarizeAdapter(adapter), limits, features, options.onError);
}
