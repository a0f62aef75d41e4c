/**
 * WebGPU in Node through Dawn (the `webgpu` package). Only Node entry points (CLI, tests, bench) import this file.
 * Without a GPU, Dawn needs a CPU Vulkan driver: we look for the ones the project's setup installs.
 */
import { existsSync } from 'node:fs';
import { WebGpuUnavailableError } from '../errors.ts';

/** CPU Vulkan drivers Dawn accepts, fastest first. Debian 12's own lavapipe (Mesa 22) is rejected by Dawn. */
export const CPU_VULKAN_ICDS = [
  '/usr/share/vulkan/icd.d/lvp_icd.json', // Mesa 25 lavapipe (bookworm-backports): f16, subgroups, faster than SwiftShader
  '/usr/lib/chromium/vk_swiftshader_icd.json', // Chromium's SwiftShader
] as const;

const INSTALL_HINT =
  'No Vulkan driver gave a WebGPU adapter. On Debian 12 install one CPU driver: ' +
  '`apt-get install -t bookworm-backports mesa-vulkan-drivers libvulkan1` (lavapipe, Mesa 25) or ' +
  '`apt-get install chromium libvulkan1` (SwiftShader); or set VK_ICD_FILENAMES to your driver.';

// Dawn's GPU object must be dropped for Node to exit, so we keep exactly one and hand out references to it.
let cached: GPU | null = null;

type DawnModule = { create: (flags: string[]) => GPU; globals: Record<string, unknown> };

/**
 * Dawn quantizes timestamp queries by default (a browser's guard against timing attacks), more coarsely than most
 * kernels take. A Node process is not a web page, and the bench's per-kernel profile needs real kernel times.
 * `allow_unsafe_apis` offers Dawn's experimental features, among them the subgroup matrices (tensor cores) the int8
 * prefill matmul runs on where the GPU has them (core/gpu/device.ts requests only what it uses).
 */
const DAWN_FLAGS = ['disable-dawn-features=timestamp_quantization', 'enable-dawn-features=allow_unsafe_apis'];

async function tryCreate(dawn: DawnModule): Promise<GPU | null> {
  const gpu = dawn.create(DAWN_FLAGS);
  const adapter = await gpu.requestAdapter();
  return adapter ? gpu : null;
}

/** A `GPU` object for Node, falling back to a CPU Vulkan driver when no GPU adapter exists. */
export async function nodeGpu(): Promise<GPU> {
  if (cached) return cached;
  process.env.XDG_RUNTIME_DIR ??= '/tmp';
  let dawn: DawnModule;
  try {
    dawn = (await import('webgpu')) as unknown as DawnModule;
  } catch (cause) {
    throw new WebGpuUnavailableError(
      `The 'webgpu' package (Dawn for Node) could not be loaded: ${String(cause)}. Run npm install.`,
    );
  }
  Object.assign(globalThis, dawn.globals);
  const explicit = process.env.VK_ICD_FILENAMES || process.env.VK_DRIVER_FILES;
  let gpu = await tryCreate(dawn);
  if (!gpu && !explicit) {
    for (const icd of CPU_VULKAN_ICDS) {
      if (!existsSync(icd)) continue;
      process.env.VK_ICD_FILENAMES = icd;
      gpu = await tryCreate(dawn);
      if (gpu) break;
    }
  }
  if (!gpu) throw new WebGpuUnavailableError(INSTALL_HINT, { tried: explicit ? [explicit] : CPU_VULKAN_ICDS });
  cached = gpu;
  return gpu;
}

/** Drops the Dawn instance so the Node process can exit. */
export function releaseNodeGpu(): void {
  cached = null;
}
