/**
 * One forward step, owned in one place: write the cache's step → write the transformer's step → encode the forward
 * (and the logits, the sampler and the copy of the chosen id) → submit → read the id back. Every caller that runs
 * the model goes through `StepRunner.submit`: generation, prefill, teacher forcing, calibration, the attention
 * captures of the evaluation and the bench, so the protocol (one submit per step, only the sampled id read back)
 * holds everywhere by construction. Constrained decode alone takes two submits a token (`submitDraw`): its draw
 * waits for a mask the host computes from the id before.
 */
import { LongtabError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { encodeDispatches, type PreparedDispatch } from '../../core/gpu/dispatch.ts';
import { prepareSampler, type Sampler, type SamplerParams } from '../../kernels/sample.ts';
import type { KvPagePool, KvSequence } from '../kv/pool.ts';
import type { LogitsMode, Transformer } from '../model/transformer.ts';

export interface StepRequest {
  /** The submit's label (default 'decode' for a sampled step, else 'prefill'). */
  label?: string;
  seq: KvSequence;
  /** First position the step writes (<= seq.length; a smaller one rewrites, as after a rollback). */
  position: number;
  /**
   * The step's token ids, at most the transformer's maxTokens. null: one decode token whose id the previous sampled
   * step left on the GPU (copied there, never read back to be sent again).
   */
  ids: readonly number[] | null;
  /** Which logits the step computes (default: 'last' when it samples, else 'none'). */
  logits?: LogitsMode;
  /**
   * Sample the last token's logits: `submit` returns the promise of the chosen id. Needs a runner with sampling.
   * `mask`: the ids the draw may take (a response format's constraint, Sampler.setMask); absent = any.
   */
  sample?: { params: SamplerParams; step: number; mask?: Uint32Array };
  /** Commands recorded in the step's submit before the forward (e.g. clearing capture buffers). */
  before?: (encoder: GPUCommandEncoder) => void;
  /** Commands recorded in the step's submit after the forward (e.g. copying captures to a staging buffer). */
  after?: (encoder: GPUCommandEncoder) => void;
}

export interface StepRunnerParts {
  pool: KvPagePool;
  transformer: Transformer;
  /** A label for the sampling buffers; with it the runner can sample (it owns a sampler over the logits). */
  sampling?: { label: string };
}

/** Readback buffers of the sampled id: two, used in turn, so a step can be queued while the previous id maps. */
const READBACK_SLOTS = 2;

export class StepRunner {
  readonly pool: KvPagePool;
  readonly transformer: Transformer;
  private readonly gpu: GpuContext;
  private readonly sampling: { sampler: Sampler; sampledId: GPUBuffer; readbacks: GPUBuffer[] } | null;
  private nextReadback = 0;

  constructor(gpu: GpuContext, parts: StepRunnerParts) {
    this.gpu = gpu;
    this.pool = parts.pool;
    this.transformer = parts.transformer;
    if (!parts.sampling) {
      this.sampling = null;
      return;
    }
    const { label } = parts.sampling;
    const created: GPUBuffer[] = [];
    try {
      const sampledId = gpu.allocator.createStorage(`${label}.sampledId`, 'scratch', 16);
      created.push(sampledId);
      const readbacks = Array.from({ length: READBACK_SLOTS }, (_, slot) => {
        const buffer = gpu.allocator.createBuffer({
          label: `${label}.sampledId.readback${slot}`,
          category: 'staging',
          size: 16,
          usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
        });
        created.push(buffer);
        return buffer;
      });
      const sampler = prepareSampler(gpu, `${label}.sampler`, {
        logits: parts.transformer.buffers.logits,
        vocab: parts.transformer.config.vocab,
        output: sampledId,
      });
      this.sampling = { sampler, sampledId, readbacks };
    } catch (error) {
      for (const b of created) gpu.allocator.release(b);
      throw error;
    }
  }

  /** Most tokens one step takes (the transformer's graph size). */
  get maxTokens(): number {
    return this.transformer.maxTokens;
  }

  /** The sampler's dispatches (the bench counts them); empty without sampling. */
  get samplerDispatches(): number {
    return this.sampling?.sampler.dispatches.length ?? 0;
  }

  /** Replaces the repetition penalty's history with the prompt's last ids. */
  resetSamplerHistory(ids: readonly number[]): void {
    this.requireSampling().sampler.resetHistory(ids);
  }

  /**
   * Records and submits one step. Returns the promise of the sampled id with `sample`, else null (the step's work
   * is queued; wait with `queue.onSubmittedWorkDone` where the caller needs it finished). Throws, before anything is
   * submitted, the pool's ContextOverflowError when the step cannot get its pages.
   */
  submit(request: StepRequest): Promise<number> | null {
    const { gpu, transformer } = this;
    const { ids } = request;
    const logits = this.write(request);
    const tokens = ids?.length ?? 1;
    // write() checked that a sampled step has a sampler.
    const sampling = request.sample ? this.sampling : null;
    const encoder = gpu.device.createCommandEncoder({ label: request.label ?? (sampling ? 'decode' : 'prefill') });
    // Page work the cache's bookkeeping asked for (copies, promotions, flushed demotions) precedes the forward.
    this.pool.encodePending(encoder);
    request.before?.(encoder);
    if (!ids && this.sampling) {
      encoder.copyBufferToBuffer(this.sampling.sampledId, 0, transformer.buffers.tokenIds, 0, 4);
    }
    transformer.encode(encoder, tokens, logits);
    let readback: GPUBuffer | null = null;
    if (sampling) readback = this.encodeDraw(encoder, sampling);
    request.after?.(encoder);
    gpu.device.queue.submit([encoder.finish()]);
    return readback ? this.readId(readback) : null;
  }

  /**
   * Draws from the last logits of the step submitted before (one with `logits: 'last'` and no `sample`), in a submit
   * of its own, and returns the promise of the chosen id. Constrained decode splits a step so: the forward that feeds
   * the previous id is queued before that id is read back, and only the draw waits for the mask the host computes
   * from it, so the GPU runs the forward while the host reads the id and builds the mask.
   */
  submitDraw(sample: NonNullable<StepRequest['sample']>): Promise<number> {
    const sampling = this.requireSampling();
    this.writeDraw(sampling, sample);
    const encoder = this.gpu.device.createCommandEncoder({ label: 'draw' });
    const readback = this.encodeDraw(encoder, sampling);
    this.gpu.device.queue.submit([encoder.finish()]);
    return this.readId(readback);
  }

  /**
   * Writes the step's uniforms (the cache's step, the transformer's ids and position, the sampler's parameters)
   * without recording anything, and returns the logits the step computes. `submit` starts with it; a profiler that
   * times the step's dispatches one by one calls it, then records `dispatches(request)` itself.
   */
  write(request: StepRequest): LogitsMode {
    const { seq, position, ids, sample } = request;
    const tokens = ids?.length ?? 1;
    const sampling = sample ? this.requireSampling() : null;
    if (!ids && !this.sampling) {
      throw new RangeError('StepRunner: a decode step from the sampled id needs a runner with sampling');
    }
    const logits = request.logits ?? (sample ? 'last' : 'none');
    if (sample && logits !== 'last') throw new RangeError("StepRunner: sampling reads the 'last' logits");
    this.pool.writeStep(seq, position, tokens);
    this.transformer.writeStep(ids, position, tokens);
    if (sampling && sample) this.writeDraw(sampling, sample);
    return logits;
  }

  /** The draw's mask and sampling parameters, for the next submit that samples. */
  private writeDraw(sampling: NonNullable<StepRunner['sampling']>, sample: NonNullable<StepRequest['sample']>): void {
    sampling.sampler.setMask(sample.mask ?? null);
    sampling.sampler.setParams(sample.params, sample.step);
  }

  /**
   * The compute dispatches `submit` records for a step of `tokens` tokens with the last token's logits (and the
   * sampler, with `sample`), in order; a dispatch whose `idle()` is true on the step written is left out by it.
   */
  dispatches(tokens: number, sample: boolean): PreparedDispatch[] {
    const graph = this.transformer.graph(tokens);
    return [...graph.body, ...graph.logits, ...(sample ? this.requireSampling().sampler.dispatches : [])];
  }

  /** Releases what the runner made (the sampler and its buffers); the pool and the transformer are the caller's. */
  release(): void {
    if (!this.sampling) return;
    this.sampling.sampler.release();
    this.gpu.allocator.release(this.sampling.sampledId);
    for (const b of this.sampling.readbacks) this.gpu.allocator.release(b);
  }

  /** The sampler's pass and the copy of its id to the next readback buffer, which it returns. */
  private encodeDraw(encoder: GPUCommandEncoder, sampling: NonNullable<StepRunner['sampling']>): GPUBuffer {
    const pass = encoder.beginComputePass({ label: 'sample' });
    encodeDispatches(pass, sampling.sampler.dispatches);
    pass.end();
    const readback = sampling.readbacks[this.nextReadback];
    this.nextReadback = (this.nextReadback + 1) % READBACK_SLOTS;
    encoder.copyBufferToBuffer(sampling.sampledId, 0, readback, 0, 4);
    return readback;
  }

  private requireSampling(): NonNullable<StepRunner['sampling']> {
    if (!this.sampling) throw new RangeError('StepRunner: this runner was made without sampling');
    return this.sampling;
  }

  private async readId(readback: GPUBuffer): Promise<number> {
    try {
      await readback.mapAsync(GPUMapMode.READ, 0, 4);
    } catch (error) {
      throw await this.lostOr(error);
    }
    const id = new Uint32Array(readback.getMappedRange(0, 4))[0];
    readback.unmap();
    this.gpu.throwIfErrors();
    return id;
  }

  /**
   * A readback that fails because the device was lost rejects with a bare AbortError; the context's DeviceLostError
   * (typed, says to reload) is what callers get instead. `lost` resolves shortly after, so wait for it briefly.
   */
  private async lostOr(error: unknown): Promise<unknown> {
    if (error instanceof LongtabError) return error;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const lost = await Promise.race([
      this.gpu.lost,
      new Promise<null>((resolve) => {
        timer = setTimeout(() => resolve(null), 1000);
      }),
    ]);
    clearTimeout(timer);
    return lost ?? error;
  }
}
