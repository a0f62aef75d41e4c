/**
 * OSCAR calibration in the background, after a load with `rotation: 'calibrated'` found no fitted rotations. The
 * engine starts with the Hadamard rotation, usable at once; meanwhile, whenever no request runs or waits:
 *   1. the model writes its own calibration text (sampled from BOS, f16 cache, `tokens` tokens),
 *   2. the two moment passes and the clip fit run (runtime/calibration/calibrate.ts),
 *   3. the result is cached under the model's digest (IndexedDB in the worker, a file in Node),
 *   4. the host switches the engine to it between two requests (LongtabEngine: conversations' KV is dropped, since
 *      their pages were written with the Hadamard rotation, and re-prefilled on their next turn).
 * Every GPU submit and every CPU step is preceded by `between()`, which waits while a request runs or waits and for
 * a short grace after it, and throws once stopped: a request is delayed by at most one step (one decode token, one
 * prefill chunk, one eigendecomposition or one layer of the clip fit), never by a whole calibration.
 */

import { calibrateKvRotations, generateCalibrationText, storedRotations } from '../calibration/calibrate.ts';
import type { RotationCache, StoredRotations } from '../kv/rotation-store.ts';
import { encodeRotations } from '../kv/rotation-store.ts';
import type { ModelConfig } from '../model/config.ts';
import type { ModelRunner } from './model-runner.ts';

/** Most calibration tokens (the whole text; OSCAR uses a few thousand). */
export const MAX_CALIBRATION_TOKENS = 4096;

/**
 * Default calibration length: 64 × headDim tokens (the d × d moments need a few times d² values: 4096 at head_dim
 * 64, 512 for stories260K's head_dim 8), at least 128, at most 4096 and the model's context length.
 */
export function defaultCalibrationTokens(config: ModelConfig): number {
  return Math.max(16, Math.min(MAX_CALIBRATION_TOKENS, config.contextLength, Math.max(128, 64 * config.headDim)));
}

export type CalibrationPhase = 'paused' | 'generating' | 'fitting' | 'switching' | 'done' | 'failed' | 'stopped';

export interface CalibrationStatus {
  phase: CalibrationPhase;
  /** 0..1 over the whole calibration (text, passes, fit, switch). */
  progress: number;
  /** Calibration tokens (the text's length). */
  tokens: number;
  /** Set when phase is 'failed'; the engine keeps the Hadamard rotation. */
  error?: string;
}

export interface BackgroundCalibrationHost {
  runner: ModelRunner;
  /** The model's digest: the cache key. */
  digest: string;
  cache?: RotationCache;
  tokens: number;
  /** When the request queue last became empty (performance.now()), or null while a request runs or waits. */
  idleSince(): number | null;
  /** Resolves the next time the request queue becomes empty. */
  whenIdle(): Promise<void>;
  /**
   * Switches the model runner to the rotations between two requests (in the request queue); false when the model was
   * unloaded or replaced meanwhile.
   */
  apply(rotations: StoredRotations): Promise<boolean>;
  /** Called on every phase change and every whole percent of progress. */
  onStatus(status: CalibrationStatus): void;
  /** Quiet time after the last request before calibration resumes (default 150 ms). */
  graceMs?: number;
  seed?: number;
}

class Stopped extends Error {
  constructor() {
    super('background calibration stopped');
    this.name = 'AbortError';
  }
}

/** Share of the progress bar each stage takes (text generation is one submit per token, so most of it). */
const STAGES = { generate: [0, 0.6], moments: [0.6, 0.85], fit: [0.85, 0.98] } as const;

export class BackgroundCalibration {
  private readonly host: BackgroundCalibrationHost;
  private stopped = false;
  /** The part that uses the GPU (text, passes) and the CPU fit; settles once its GPU memory is released. */
  private fitting: Promise<StoredRotations | null> | null = null;
  private wake: (() => void) | null = null;
  private state: CalibrationStatus;
  private working: CalibrationPhase = 'generating';

  constructor(host: BackgroundCalibrationHost) {
    this.host = host;
    this.state = { phase: 'paused', progress: 0, tokens: host.tokens };
  }

  get status(): CalibrationStatus {
    return this.state;
  }

  /** Starts the calibration (it first waits for the queue to be idle). Failures end in phase 'failed'. */
  start(): void {
    if (this.fitting) return;
    const fail = (error: unknown) => {
      if (error instanceof Stopped || this.stopped) this.update({ phase: 'stopped' });
      else this.update({ phase: 'failed', error: error instanceof Error ? error.message : String(error) });
      return null;
    };
    this.fitting = this.fit().catch(fail);
    this.fitting
      .then(async (rotations) => {
        if (!rotations) return;
        this.working = 'switching';
        this.update({ phase: 'switching' });
        await this.between();
        this.update({ phase: (await this.host.apply(rotations)) ? 'done' : 'stopped', progress: 1 });
      })
      .catch(fail);
  }

  /**
   * Stops at the next step and waits until the calibration holds no GPU memory. (Not for the switch: that one is
   * queued as a request, and checks itself whether its model is still loaded.)
   */
  async stop(): Promise<void> {
    this.stopped = true;
    this.wake?.();
    await this.fitting;
  }

  private async fit(): Promise<StoredRotations | null> {
    const { runner, tokens: count } = this.host;
    const loaded = runner.loaded;
    if (!loaded) throw new Stopped();
    const { config, weights, tokenizer } = loaded;
    const gpu = runner.gpu;
    const between = () => this.between();
    this.working = 'generating';
    await between();
    const prompt =
      tokenizer.bosId !== undefined ? [tokenizer.bosId] : tokenizer.encode('The', { addSpecial: true }).slice(0, 1);
    if (prompt.length === 0) throw new Error('This model has no BOS token to start calibration text from.');
    const text = await generateCalibrationText(gpu, config, weights, {
      prompt,
      count,
      seed: this.host.seed,
      between,
      onProgress: (done, total) => this.progress(STAGES.generate, done / total),
    });
    this.working = 'fitting';
    const fitted = await calibrateKvRotations(gpu, config, weights, text, {
      between,
      chunk: Math.min(128, loaded.transformer.maxTokens),
      clip: this.clipFormat(),
      onProgress: (done, total) => this.progress(STAGES.moments, done / total),
      onFitProgress: (done, total) => this.progress(STAGES.fit, done / total),
    });
    const rotations = storedRotations(fitted);
    await between();
    if (this.host.cache) {
      try {
        await this.host.cache.set(this.host.digest, encodeRotations(rotations));
      } catch (error) {
        // A full or unavailable cache only costs a recalibration at the next load.
        console.warn('longtab: could not cache the calibrated KV rotations:', error);
      }
    }
    return rotations;
  }

  /** The row format the clip quantiles are fitted for: the runner's own. */
  private clipFormat() {
    const quant = this.host.runner.loaded?.pool.quant;
    return quant ? { bits: quant.key.bits, groupSize: quant.key.groupSize } : {};
  }

  private progress(stage: readonly [number, number], fraction: number): void {
    const progress = stage[0] + (stage[1] - stage[0]) * Math.min(1, Math.max(0, fraction));
    if (Math.floor(progress * 100) !== Math.floor(this.state.progress * 100) || this.state.phase !== this.working)
      this.update({ phase: this.working, progress });
    else this.state = { ...this.state, progress };
  }

  private update(change: Partial<CalibrationStatus>): void {
    this.state = { ...this.state, ...change };
    this.host.onStatus(this.state);
  }

  /** Returns when the queue has been idle for the grace period; throws once stopped. */
  private async between(): Promise<void> {
    const grace = this.host.graceMs ?? 150;
    for (;;) {
      if (this.stopped) throw new Stopped();
      const since = this.host.idleSince();
      const wait = since === null ? null : grace - (performance.now() - since);
      if (wait !== null && wait <= 0) {
        if (this.state.phase === 'paused') this.update({ phase: this.working });
        return;
      }
      if (this.state.phase !== 'paused') this.update({ phase: 'paused' });
      await new Promise<void>((resolve) => {
        this.wake = resolve;
        if (wait === null) this.host.whenIdle().then(resolve);
        else setTimeout(resolve, wait);
      });
      this.wake = null;
    }
  }
}
