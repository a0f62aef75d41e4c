import type { GgmlType } from '../../core/gguf-types.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import {
  encodeDispatches,
  type PreparedDispatch,
  prepareAllOrNone,
  releaseDispatches,
  uniformBuffer,
} from '../../core/gpu/dispatch.ts';
import { prepareSwiglu } from '../../kernels/elementwise.ts';
import { prepareEmbedding } from '../../kernels/embedding.ts';
import { type MatmulBinding, prepareMatmul, prepareMatvecGroup, prepareMatvecSwiglu } from '../../kernels/matmul.ts';
import {
  createInt8Activations,
  defaultInt8Variant,
  type Int8Activations,
  int8MatmulAvailable,
  int8MatmulCompiles,
  prepareInt8Matmul,
  prepareQuantizeActivations,
  releaseInt8Activations,
} from '../../kernels/matmul-int8.ts';
import { prepareRmsNorm } from '../../kernels/rmsnorm.ts';
import { NO_ROPE_SCALING, type RopeStage, ropeMagnitude } from '../../kernels/rope.ts';
import { layerUsesRope, layerWindow, type ModelConfig } from './config.ts';
import type { ModelWeights } from './weights.ts';

/**
 * What the forward pass needs from the KV cache: per layer, the dispatches that take this step's q, k and v from the
 * projections, apply `rope` to q and k (null: they are final) and store k/v (`append`), and those that compute the
 * attention of this step's queries over the sequence's pages (`attention`). The cache owns everything between the
 * projections and the attention output, so it can fuse it (kernels/rope-append.ts). It binds its own per-step uniform
 * (positions, page table slice), which `beginStep` writes before the submit.
 */
export interface KvAttentionBackend {
  prepareLayer(
    layer: number,
    buffers: { q: GPUBuffer; k: GPUBuffer; v: GPUBuffer; output: GPUBuffer },
    maxTokens: number,
    rope: RopeStage | null,
    attention?: LayerAttention,
  ): { append: PreparedDispatch[]; attention: PreparedDispatch[] };
}

/**
 * How a layer's queries attend, as the model defines it: the scale of q·k (absent: 1/sqrt(headDim)) and, in a
 * sliding-window layer, the keys a query sees (its own and the window − 1 before it; null: the whole sequence).
 */
export interface LayerAttention {
  scale: number;
  window: number | null;
}

/** Scratch activations for up to `maxTokens` tokens per forward call. */
interface Activations {
  tokenIds: GPUBuffer;
  x: GPUBuffer;
  xNorm: GPUBuffer;
  q: GPUBuffer;
  k: GPUBuffer;
  v: GPUBuffer;
  attention: GPUBuffer;
  gate: GPUBuffer;
  up: GPUBuffer;
  hidden: GPUBuffer;
  lastHidden: GPUBuffer;
  logits: GPUBuffer;
  /** Uniform { position, tokens }: written before each submit. */
  step: GPUBuffer;
}

/** The dispatches of one forward call over `tokens` tokens: recorded once, replayed every step. */
export interface ForwardGraph {
  tokens: number;
  body: PreparedDispatch[];
  /** Logits of the last token into `buffers.logits`. */
  logits: PreparedDispatch[];
  /** Logits of every token into the evaluation buffer (perplexity, oracle tests); prepared on first use. */
  allLogits?: PreparedDispatch[];
}

export type PrefillMatmul = 'auto' | 'f32' | 'int8-dot';

/**
 * The int8 kernels a prefill-matmul choice may run: 'auto' on a device with tensor cores, the 32x32 tensor-core tile
 * or dot4I8Packed per weight (defaultInt8Variant); 'int8-dot', dot4I8Packed for every weight; otherwise none.
 */
function int8Kernels(gpu: GpuContext, prefillMatmul: PrefillMatmul): ('32x32' | 'dot4')[] {
  if (prefillMatmul === 'int8-dot') return ['dot4'];
  return prefillMatmul === 'auto' && gpu.features.subgroupMatrixI8 ? ['32x32', 'dot4'] : [];
}

export interface TransformerOptions {
  /**
   * 'auto' (default): prefill projections run on the int8 matmuls where the device offers i8 subgroup matrices and
   * the weight type has int8 codes (kernels/matmul-int8.ts: activations quantized per 32 elements, as llama.cpp's
   * MMQ), on tensor cores or dot4I8Packed as measured fastest (defaultInt8Variant); 'int8-dot': the int8 matmul on
   * dot4I8Packed for every weight, which every adapter runs (measured only on a GPU that has tensor cores too:
   * 'auto' takes it only on such devices); 'f32': always the f32 kernels.
   * Decode steps use the matvecs.
   */
  prefillMatmul?: PrefillMatmul;
}

/** Whether prefill projections run on an int8 matmul: some weight type of the model has one of the choice's kernels. */
function int8PrefillApplies(gpu: GpuContext, weights: ModelWeights, prefillMatmul: PrefillMatmul): boolean {
  const kernels = int8Kernels(gpu, prefillMatmul);
  return projectionTypes(weights).some((type) => kernels.some((k) => int8MatmulAvailable(gpu, type, k)));
}

/**
 * int8PrefillApplies, and each kernel it may run compiles here (kernels/matmul-int8.ts, int8MatmulCompiles): a
 * browser that does not take their WGSL gets the f32 kernels at load, not an error at the first prompt.
 */
export async function int8PrefillReady(
  gpu: GpuContext,
  weights: ModelWeights,
  prefillMatmul: PrefillMatmul,
): Promise<boolean> {
  if (!int8PrefillApplies(gpu, weights, prefillMatmul)) return false;
  const types = projectionTypes(weights);
  for (const kernel of int8Kernels(gpu, prefillMatmul)) {
    const used = types.some((type) => int8MatmulAvailable(gpu, type, kernel));
    if (used && !(await int8MatmulCompiles(gpu, types, kernel))) return false;
  }
  return true;
}

/** Weight types of the first layer's projections (the layers share them). */
function projectionTypes(weights: ModelWeights): GgmlType[] {
  const l = weights.layers[0];
  return l ? [l.q, l.k, l.v, l.o, l.gate, l.up, l.down].map((weight) => weight.type) : [];
}

/** Which logits a forward call produces. */
export type LogitsMode = 'none' | 'last' | 'all';

/**
 * The transformer forward pass, as one list of prepared dispatches per token count. It reads like the math:
 * x = embed(tokens); per layer x += o(attn(rope(q), rope(k), v)); x += down(silu(gate)·up); logits = out(norm(x)).
 * Gemma: x = embed·sqrt(dim); x += norm(o(...)); x += norm(down(gelu(gate)·up)); local layers attend in a window.
 * SmolLM3: every 4th layer attends with q and k as projected, without RoPE.
 * Decode steps (one token) fuse what shares an input: q/k/v in one dispatch, gate/up/SwiGLU in one.
 */
export class Transformer {
  readonly config: ModelConfig;
  readonly maxTokens: number;
  readonly buffers: Activations;
  private readonly gpu: GpuContext;
  private readonly weights: ModelWeights;
  private readonly kv: KvAttentionBackend;
  private readonly graphs = new Map<number, ForwardGraph>();
  private readonly stepWords = new Uint32Array(4);
  /** The int8 prefill matmul's quantized activations (null: the f32 kernels run every projection). */
  private readonly int8: Int8Activations | null;
  /**
   * Whether prefill graphs compute the down projection's input, silu(gate)·up, inside its int8 quantizer instead of a
   * swiglu pass (the pass in bench/results/2026-12-01-nvidia-h200-session18-profile-qwen3-16k-1024-f16.txt, gone in
   * ...-session19-profile-qwen3-16k-1024-f16.txt): where every down projection runs on int8 at every prefill size
   * (defaultInt8Variant falls back to dot4I8Packed, which reads every type it serves).
   * `hidden` then holds only a decode step's (40 MB less for Qwen3-4B's 1024-token chunks).
   */
  private readonly swigluInQuantizer: boolean;
  private readonly prefillMatmul: PrefillMatmul;

  constructor(
    gpu: GpuContext,
    config: ModelConfig,
    weights: ModelWeights,
    kv: KvAttentionBackend,
    maxTokens: number,
    options: TransformerOptions = {},
  ) {
    this.gpu = gpu;
    this.config = config;
    this.weights = weights;
    this.kv = kv;
    this.maxTokens = maxTokens;
    const c = config;
    const f32 = (label: string, count: number) => gpu.allocator.createStorage(label, 'scratch', count * 4);
    this.prefillMatmul = options.prefillMatmul ?? 'auto';
    const int8 = maxTokens > 1 && int8PrefillApplies(gpu, weights, this.prefillMatmul);
    this.swigluInQuantizer = int8 && weights.layers.every((l) => int8MatmulAvailable(gpu, l.down.type, 'dot4'));
    this.buffers = {
      tokenIds: f32('tokenIds', maxTokens),
      x: f32('x', maxTokens * c.dim),
      xNorm: f32('xNorm', maxTokens * c.dim),
      q: f32('q', maxTokens * c.heads * c.headDim),
      k: f32('k', maxTokens * c.kvHeads * c.headDim),
      v: f32('v', maxTokens * c.kvHeads * c.headDim),
      attention: f32('attention', maxTokens * c.heads * c.headDim),
      gate: f32('gate', maxTokens * c.ffnDim),
      up: f32('up', maxTokens * c.ffnDim),
      hidden: f32('hidden', (this.swigluInQuantizer ? 1 : maxTokens) * c.ffnDim),
      lastHidden: f32('lastHidden', c.dim),
      logits: f32('logits', c.vocab),
      step: uniformBuffer(gpu, 'step', [0, 0, 0, 0], 'uuuu'),
    };
    const widest = Math.max(c.dim, c.ffnDim, c.heads * c.headDim);
    this.int8 = int8 ? createInt8Activations(gpu, 'int8', maxTokens, widest) : null;
  }

  /**
   * Projections of one `input` over `tokens` tokens: on the int8 matmul where it applies (the input quantized once
   * for all of them), prepareMatmul otherwise (the matvec for one token, the f32 tiled kernels). With `up`, `input`
   * is the feed-forward's gate and the quantizer takes silu(gate)·up (swigluInQuantizer): every projection must run
   * on int8.
   */
  /**
   * Projections of one input: in a decode step one matvec-group dispatch where they can share one (a decode step is
   * bound by dispatch gaps, not arithmetic), else project().
   */
  private projectGrouped(
    label: string,
    input: GPUBuffer,
    tokens: number,
    projections: (Omit<MatmulBinding, 'input' | 'tokens'> & { label: string })[],
  ): PreparedDispatch[] {
    const group =
      tokens === 1 &&
      prepareMatvecGroup(
        this.gpu,
        label,
        input,
        projections.map(({ weight, output, bias }) => ({ weight, output, bias })),
      );
    return group ? [group] : this.project(label, input, tokens, projections);
  }

  private project(
    label: string,
    input: GPUBuffer,
    tokens: number,
    projections: (Omit<MatmulBinding, 'input' | 'tokens'> & { label: string })[],
    up?: GPUBuffer,
  ): PreparedDispatch[] {
    const { gpu, int8 } = this;
    const variant = (weight: MatmulBinding['weight']) =>
      this.prefillMatmul === 'int8-dot' ? 'dot4' : defaultInt8Variant(gpu, weight, tokens);
    const onInt8 = (weight: MatmulBinding['weight']) =>
      int8 !== null && tokens > 1 && int8MatmulAvailable(gpu, weight.type, variant(weight));
    if (up && !projections.every((p) => onInt8(p.weight))) {
      throw new Error(
        `'${label}': silu(gate)·up is computed only by the int8 quantizer, and a projection is not on int8`,
      );
    }
    const dispatches: PreparedDispatch[] = [];
    const first = projections.find((p) => onInt8(p.weight));
    if (first && int8) {
      dispatches.push(
        prepareQuantizeActivations(gpu, `${label}.quantize`, {
          input,
          up,
          activation: this.config.ffnActivation,
          activations: int8,
          tokens,
          K: first.weight.rowLength,
        }),
      );
    }
    for (const { label: name, ...p } of projections) {
      dispatches.push(
        ...(int8 && onInt8(p.weight)
          ? prepareInt8Matmul(gpu, name, { ...p, activations: int8, tokens }, variant(p.weight))
          : prepareMatmul(gpu, name, { ...p, input, tokens })),
      );
    }
    return dispatches;
  }

  /**
   * Writes this step's token ids (null: the caller fills `buffers.tokenIds` on the GPU, e.g. from the sampler) and
   * position; the KV cache writes its own step uniform separately.
   */
  writeStep(tokenIds: ArrayLike<number> | null, position: number, tokens = tokenIds?.length ?? 0): void {
    if (tokens > this.maxTokens) throw new RangeError(`forward over ${tokens} tokens > ${this.maxTokens}`);
    const queue = this.gpu.device.queue;
    if (tokenIds) queue.writeBuffer(this.buffers.tokenIds, 0, Uint32Array.from(tokenIds));
    this.stepWords[0] = position;
    this.stepWords[1] = tokens;
    queue.writeBuffer(this.buffers.step, 0, this.stepWords);
  }

  graph(tokens: number): ForwardGraph {
    let g = this.graphs.get(tokens);
    if (!g) {
      // A graph that cannot be prepared (a kernel refusing a shape) releases what it prepared before it throws.
      let logits: PreparedDispatch[] = [];
      const body = prepareAllOrNone(this.gpu, (made) => {
        logits = this.buildGraph(tokens, made);
      });
      g = { tokens, body, logits };
      this.graphs.set(tokens, g);
    }
    return g;
  }

  /**
   * Records the forward pass into `encoder`: 'last' leaves the last token's logits in `buffers.logits`,
   * 'all' every token's logits in `allLogitsBuffer()` ([tokens, vocab]).
   */
  encode(encoder: GPUCommandEncoder, tokens: number, mode: LogitsMode): void {
    const g = this.graph(tokens);
    const body = encoder.beginComputePass({ label: `forward[${tokens}]` });
    encodeDispatches(body, g.body);
    body.end();
    if (mode === 'none') return;
    if (mode === 'all') {
      g.allLogits ??= prepareMatmul(this.gpu, 'output.all', {
        weight: this.weights.output,
        bias: this.weights.outputBias,
        input: this.buffers.xNorm,
        output: this.allLogitsBuffer(),
        tokens,
      });
      const head = encoder.beginComputePass({ label: 'logits.all' });
      encodeDispatches(head, g.allLogits);
      head.end();
      return;
    }
    const rowBytes = this.config.dim * 4;
    encoder.copyBufferToBuffer(this.buffers.xNorm, (tokens - 1) * rowBytes, this.buffers.lastHidden, 0, rowBytes);
    const head = encoder.beginComputePass({ label: 'logits' });
    encodeDispatches(head, g.logits);
    head.end();
  }

  private allLogits: GPUBuffer | null = null;

  /** f32 [maxTokens, vocab], created on first use: generation never needs it. */
  allLogitsBuffer(): GPUBuffer {
    this.allLogits ??= this.gpu.allocator.createStorage(
      'logits.all',
      'scratch',
      this.maxTokens * this.config.vocab * 4,
    );
    return this.allLogits;
  }

  /** Pushes the body of the graph of `tokens` tokens into `body` as it is prepared; returns its logits dispatches. */
  private buildGraph(tokens: number, body: PreparedDispatch[]): PreparedDispatch[] {
    const { gpu, config: c, weights: w, buffers: b } = this;
    body.push(
      ...prepareEmbedding(gpu, 'embed', {
        weight: w.embedding,
        tokenIds: b.tokenIds,
        output: b.x,
        tokens,
        scale: c.embeddingScale,
      }),
    );
    const activation = c.ffnActivation;
    for (let i = 0; i < c.layers; i++) {
      const l = w.layers[i];
      const p = `blk.${i}`;
      body.push(
        prepareRmsNorm(gpu, `${p}.attn_norm`, {
          input: b.x,
          weight: l.attnNorm,
          output: b.xNorm,
          rows: tokens,
          dim: c.dim,
          eps: c.rmsEps,
        }),
      );
      // q, k and v share one dispatch in a decode step where they can.
      body.push(
        ...this.projectGrouped(`${p}.qkv`, b.xNorm, tokens, [
          { label: `${p}.q`, weight: l.q, output: b.q, bias: l.qBias },
          { label: `${p}.k`, weight: l.k, output: b.k, bias: l.kBias },
          { label: `${p}.v`, weight: l.v, output: b.v, bias: l.vBias },
        ]),
      );
      // RoPE (with Qwen3's and Gemma's per-head q/k norm first) is applied by the cache, with the store of k and v. A
      // sliding-window layer rotates with its own base and no context scaling (llama.cpp's freq_scale_swa = 1).
      // SmolLM3's no-RoPE layers hand the cache no stage (q and k are final as projected; none has q/k norms).
      const window = layerWindow(c, i);
      const local = window !== null && c.slidingWindow !== null && w.localRopeFreqFactors !== undefined;
      const rope: RopeStage = {
        freqFactors: local ? w.localRopeFreqFactors! : w.ropeFreqFactors,
        step: b.step,
        heads: c.heads,
        kvHeads: c.kvHeads,
        headDim: c.headDim,
        ropeDim: c.ropeDim,
        base: local ? c.slidingWindow!.ropeBase : c.ropeBase,
        layout: c.ropeLayout,
        magnitude: ropeMagnitude(local ? { ...NO_ROPE_SCALING, attnFactor: c.ropeScaling.attnFactor } : c.ropeScaling),
        headNorm: l.qNorm && l.kNorm ? { q: l.qNorm, k: l.kNorm, eps: c.rmsEps } : undefined,
      };
      const stage = layerUsesRope(c, i) ? rope : null;
      const kv = this.kv.prepareLayer(i, { q: b.q, k: b.k, v: b.v, output: b.attention }, tokens, stage, {
        scale: c.attentionScale,
        window,
      });
      body.push(...kv.append, ...kv.attention);
      // The residual connections are added by the projections themselves (accumulate): x += o·attention. With
      // post-norms (Gemma) x += norm(o·attention): o writes xNorm (free once q, k and v have read it) and the norm adds
      // it into x.
      const post = l.attnPostNorm && l.ffnPostNorm ? { attn: l.attnPostNorm, ffn: l.ffnPostNorm } : null;
      const residual = post ? { output: b.xNorm, accumulate: false } : { output: b.x, accumulate: true };
      const addNormed = (label: string, weight: GPUBuffer) =>
        prepareRmsNorm(gpu, label, {
          input: b.xNorm,
          weight,
          output: b.x,
          rows: tokens,
          dim: c.dim,
          eps: c.rmsEps,
          add: true,
        });
      body.push(
        ...this.project(`${p}.o`, b.attention, tokens, [{ label: `${p}.o`, weight: l.o, bias: l.oBias, ...residual }]),
      );
      if (post) body.push(addNormed(`${p}.post_attention_norm`, post.attn));
      body.push(
        prepareRmsNorm(gpu, `${p}.ffn_norm`, {
          input: b.x,
          weight: l.ffnNorm,
          output: b.xNorm,
          rows: tokens,
          dim: c.dim,
          eps: c.rmsEps,
        }),
      );
      // The fused decode matvec computes act(gate)·up without biases: with them, gate and up share a matvec group.
      const gateUp =
        tokens === 1 &&
        !l.gateBias &&
        !l.upBias &&
        prepareMatvecSwiglu(gpu, `${p}.gate_up`, {
          gate: l.gate,
          up: l.up,
          input: b.xNorm,
          output: b.hidden,
          activation,
        });
      // The down projection reads act(gate)·up: from `hidden` where the decode matvec or an elementwise pass wrote it,
      // or from gate and up in its quantizer. With post-norms it writes xNorm (which gate and up have read).
      const down = [{ label: `${p}.down`, weight: l.down, bias: l.downBias, ...residual }];
      if (gateUp) {
        body.push(gateUp, ...this.project(`${p}.down`, b.hidden, tokens, down));
      } else {
        body.push(
          ...this.projectGrouped(`${p}.gate_up`, b.xNorm, tokens, [
            { label: `${p}.gate`, weight: l.gate, output: b.gate, bias: l.gateBias },
            { label: `${p}.up`, weight: l.up, output: b.up, bias: l.upBias },
          ]),
        );
        if (tokens > 1 && this.swigluInQuantizer) {
          body.push(...this.project(`${p}.down`, b.gate, tokens, down, b.up));
        } else {
          body.push(
            prepareSwiglu(gpu, `${p}.${activation}`, {
              gate: b.gate,
              up: b.up,
              output: b.hidden,
              count: tokens * c.ffnDim,
              activation,
            }),
            ...this.project(`${p}.down`, b.hidden, tokens, down),
          );
        }
      }
      if (post) body.push(addNormed(`${p}.post_ffw_norm`, post.ffn));
    }
    body.push(
      prepareRmsNorm(gpu, 'output_norm', {
        input: b.x,
        weight: w.outputNorm,
        output: b.xNorm,
        rows: tokens,
        dim: c.dim,
        eps: c.rmsEps,
      }),
    );
    return prepareMatmul(gpu, 'output', {
      weight: w.output,
      bias: w.outputBias,
      input: b.lastHidden,
      output: b.logits,
      tokens: 1,
    });
  }

  release(): void {
    for (const g of this.graphs.values()) releaseDispatches(this.gpu, [...g.body, ...g.logits, ...(g.allLogits ?? [])]);
    this.graphs.clear();
    if (this.allLogits) this.gpu.allocator.release(this.allLogits);
    this.allLogits = null;
    for (const buffer of Object.values(this.buffers)) this.gpu.allocator.release(buffer);
    if (this.int8) releaseInt8Activations(this.gpu, this.int8);
  }
}
