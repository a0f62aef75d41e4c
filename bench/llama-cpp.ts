/**
 * Native llama.cpp on the same GGUF files, through node-llama-cpp: the baseline each longtab row is divided by.
 * Same protocol as the engine runner (bench/engine-runner.ts): a prompt of P = context − decodeSteps random ids is
 * evaluated (prefill; the first token is sampled greedily at its end = TTFT), then `decodeSteps` single-token steps,
 * each timed from one yielded token to the next.
 */
import type { Llama, LlamaContext, LlamaModel, Token } from 'node-llama-cpp';
import type { BenchModelFile } from './models.ts';
import { type RowTiming, summarize, type TimedRepeat } from './stats.ts';

export type LlamaKvType = 'f16' | 'q4_0';
export type LlamaBackend = 'vulkan' | 'cpu';

export interface LlamaRunnerOptions {
  backend: LlamaBackend;
  threads: number;
  batchSize: number;
  flashAttention: boolean;
  log: (line: string) => void;
}

export interface LlamaInfo {
  backend: LlamaBackend;
  gpu: string | false;
  llamaCppRelease: string;
  nodeLlamaCppVersion: string;
  threads: number;
  batchSize: number;
  flashAttention: boolean;
  gpuDevices: string[];
}

/** Bytes one cached position takes in llama.cpp's KV cache (K and V, every layer). */
export function llamaKvBytesPerToken(file: BenchModelFile, kv: LlamaKvType): number {
  const s = file.shape;
  const elements = 2 * s.layers * s.kvHeads * s.headDim;
  return kv === 'f16' ? elements * 2 : (elements / 32) * 18;
}

export class LlamaCppRunner {
  readonly info: LlamaInfo;
  private readonly llama: Llama;
  private readonly options: LlamaRunnerOptions;
  private model: LlamaModel | null = null;
  private modelPath = '';
  /** Device VRAM in use before the model was loaded (Vulkan only). */
  private vramBaseline: number | null = null;

  private constructor(llama: Llama, info: LlamaInfo, options: LlamaRunnerOptions) {
    this.llama = llama;
    this.info = info;
    this.options = options;
  }

  static async create(options: LlamaRunnerOptions): Promise<LlamaCppRunner> {
    const { getLlama, LlamaLogLevel } = await import('node-llama-cpp');
    const llama = await getLlama({
      gpu: options.backend === 'vulkan' ? 'vulkan' : false,
      build: 'never',
      usePrebuiltBinaries: true,
      progressLogs: false,
      logLevel: LlamaLogLevel.error,
      logger: (level, message) => {
        if (level === LlamaLogLevel.error || level === LlamaLogLevel.fatal) options.log(`llama.cpp: ${message.trim()}`);
      },
    });
    let gpuDevices: string[] = [];
    // A Vulkan build with no GPU device (a CPU Vulkan driver: llama.cpp skips those) runs on its CPU backend.
    try {
      gpuDevices = await llama.getGpuDeviceNames();
    } catch {
      gpuDevices = [];
    }
    let version = 'unknown';
    try {
      const { createRequire } = await import('node:module');
      version = (createRequire(import.meta.url)('node-llama-cpp/package.json') as { version: string }).version;
    } catch {
      // The bundled GPU kit resolves the package differently; the release below still identifies llama.cpp.
    }
    const info: LlamaInfo = {
      backend: options.backend,
      gpu: llama.gpu,
      llamaCppRelease: `${llama.llamaCppRelease.repo}@${llama.llamaCppRelease.release}`,
      nodeLlamaCppVersion: version,
      threads: options.threads,
      batchSize: options.batchSize,
      flashAttention: options.flashAttention,
      gpuDevices,
    };
    return new LlamaCppRunner(llama, info, options);
  }

  async loadModel(path: string): Promise<void> {
    if (this.model && this.modelPath === path) return;
    await this.unloadModel();
    this.vramBaseline = await this.vramUsed();
    this.model = await this.llama.loadModel({
      modelPath: path,
      gpuLayers: this.options.backend === 'vulkan' ? 'max' : 0,
    });
    this.modelPath = path;
  }

  async unloadModel(): Promise<void> {
    await this.model?.dispose();
    this.model = null;
  }

  /** One row: warm-up, then `repeats` timed prefill + decode runs (fewer when a repeat would pass `budgetMs`). */
  async measure(request: {
    kv: LlamaKvType;
    context: number;
    decodeSteps: number;
    repeats: number;
    warmupTokens: number;
    budgetMs: number;
    promptIds: number[];
  }): Promise<{ timing: RowTiming; vramUsedBytes: number | null }> {
    const model = this.model;
    if (!model) throw new Error('loadModel first');
    const type = request.kv === 'f16' ? 'F16' : 'Q4_0';
    const context: LlamaContext = await model.createContext({
      contextSize: request.context,
      batchSize: Math.min(this.options.batchSize, request.context),
      threads: this.options.threads,
      flashAttention: this.options.flashAttention,
      experimentalKvCacheKeyType: type,
      experimentalKvCacheValueType: type,
      sequences: 1,
    });
    try {
      const vramAfter = await this.vramUsed();
      const sequence = context.getSequence();
      const run = async (ids: number[], tokens: number): Promise<TimedRepeat> => {
        await sequence.clearHistory();
        const start = performance.now();
        const stamps: number[] = [];
        for await (const _token of sequence.evaluate(ids as Token[], { temperature: 0 })) {
          stamps.push(performance.now());
          if (stamps.length >= tokens) break;
        }
        return repeatFromStamps(ids.length, start, stamps);
      };
      await run(request.promptIds.slice(0, request.warmupTokens), Math.min(4, request.decodeSteps + 1));
      const repeats: TimedRepeat[] = [];
      const started = performance.now();
      for (let r = 0; r < request.repeats; r++) {
        repeats.push(await run(request.promptIds, request.decodeSteps + 1));
        const perRepeat = (performance.now() - started) / repeats.length;
        if (performance.now() - started + perRepeat > request.budgetMs) break;
      }
      await sequence.clearHistory();
      return {
        timing: summarize(repeats, request.repeats),
        // Model + this context, as longtab's allocator total counts weights + KV + scratch.
        vramUsedBytes: this.vramBaseline !== null && vramAfter !== null ? vramAfter - this.vramBaseline : null,
      };
    } finally {
      await context.dispose();
    }
  }

  private async vramUsed(): Promise<number | null> {
    if (this.options.backend !== 'vulkan') return null;
    try {
      return (await this.llama.getVramState()).used;
    } catch {
      return null;
    }
  }

  async dispose(): Promise<void> {
    await this.unloadModel();
    await this.llama.dispose();
  }
}

/** A repeat from the prompt length, the start time and the time each generated token was yielded. */
export function repeatFromStamps(promptTokens: number, start: number, stamps: number[]): TimedRepeat {
  const ttftMs = stamps.length > 0 ? stamps[0] - start : Number.NaN;
  const steps: number[] = [];
  for (let i = 1; i < stamps.length; i++) steps.push(stamps[i] - stamps[i - 1]);
  return { promptTokens, ttftMs, prefillTokensPerSecond: promptTokens / (ttftMs / 1000), stepMs: steps };
}
