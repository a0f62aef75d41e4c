/**
 * The API engine for Node (CLI, tests, scripts): Dawn's WebGPU and file paths as model sources. Browser bundles
 * never import this module (it pulls in `node:fs` and `webgpu`).
 */

import { acquireGpu, type GpuContext } from '../../core/gpu/device.ts';
import { nodeGpu } from '../../core/gpu/node.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { LongtabEngine } from './api.ts';
import type { KvFileStore } from './kv-file-store.ts';

export interface NodeEngineOptions {
  /** An existing device (tests share one per file); by default the engine acquires its own through Dawn. */
  gpu?: GpuContext;
  /**
   * Where conversations' KV goes below host memory and persists (load or request option `persist`), e.g.
   * `nodeKvFileStore()` (a directory under LONGTAB_CACHE_DIR); default none.
   */
  kvStore?: KvFileStore;
}

export function createNodeEngine(options: NodeEngineOptions = {}): LongtabEngine {
  return new LongtabEngine({
    gpu: options.gpu ?? (async () => acquireGpu({ gpu: await nodeGpu() })),
    openPath: sourceFromPath,
    rotationCache: nodeRotationCache(),
    ...(options.kvStore ? { kvStore: options.kvStore } : {}),
  });
}
