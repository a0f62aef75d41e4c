/** Which commit the bench runs and on which adapter: for result files' names and headers. */
import { execFileSync } from 'node:child_process';
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import type { GpuContext } from '../core/gpu/device.ts';

/** The commit the bench runs (the GPU bundle has it built in; `+dirty` when the working tree has changes). */
export function sourceCommit(): string {
  if (process.env.LONGTAB_BENCH_COMMIT) return process.env.LONGTAB_BENCH_COMMIT;
  try {
    const head = execFileSync('git', ['rev-parse', 'HEAD'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
    const dirty = execFileSync('git', ['status', '--porcelain', '--untracked-files=no'], {
      encoding: 'utf8',
      stdio: ['ignore', 'pipe', 'ignore'],
    });
    return `${head.trim()}${dirty.trim() ? '+dirty' : ''}`;
  } catch {
    return 'unknown';
  }
}

function slug(text: string): string {
  return (
    text
      .toLowerCase()
      .replace(/[^a-z0-9]+/g, '-')
      .replace(/^-|-$/g, '')
      .slice(0, 40) || 'unknown'
  );
}

/** Short adapter name for file names: 'nvidia-h200', 'lavapipe', 'swiftshader'. */
export function adapterSlug(gpu: GpuContext): string {
  const a = gpu.adapter;
  const text = `${a.vendor} ${a.device} ${a.description}`;
  if (/llvmpipe|lavapipe/i.test(text)) return 'lavapipe';
  if (/swiftshader/i.test(text)) return 'swiftshader';
  return slug(a.device || a.description || a.vendor);
}

/** A CPU Vulkan driver (lavapipe/llvmpipe, SwiftShader) rather than a GPU: llama.cpp then runs on the CPU. */
export function isCpuAdapter(gpu: GpuContext): boolean {
  const a = gpu.adapter;
  return a.isFallbackAdapter || /llvmpipe|lavapipe|swiftshader|cpu/i.test(`${a.vendor} ${a.device} ${a.description}`);
}

/**
 * Runs a bench script's `main` when its module is the process's entry (`node` or `tsx` on that file, or its bundle),
 * exiting 0 after it, or 1 with the error's stack.
 */
export function runAsEntry(moduleUrl: string, main: () => Promise<void>): void {
  const entry = process.argv[1];
  if (!entry || moduleUrl !== pathToFileURL(resolve(entry)).href) return;
  main().then(
    () => process.exit(0),
    (error) => {
      process.stderr.write(`${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`);
      process.exit(1);
    },
  );
}
