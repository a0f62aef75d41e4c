import { CorruptModelFileError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufFile, GgufMetadata, GgufTensorInfo, GgufValue } from '../../core/gguf-types.ts';
import { ATTENTION_MAX_HEAD_DIM, attentionRunsHeadDim } from '../../kernels/attention.wgsl.ts';
import type { GatedActivation } from '../../kernels/elementwise.wgsl.ts';
import { NO_ROPE_SCALING, type RopeLayout, type RopeScaling } from '../../kernels/rope.ts';
import { metaNumber, metaOptionalNumber, metaOptionalString, metaString } from '../gguf/metadata.ts';

export type Architecture = 'llama' | 'qwen2' | 'qwen3' | 'gemma3' | 'smollm3' | 'phi3';
export const SUPPORTED_ARCHITECTURES: readonly Architecture[] = [
  'llama',
  'qwen2',
  'qwen3',
  'gemma3',
  'smollm3',
  'phi3',
];

/** Everything the forward pass needs to know about a model's shape, read once from GGUF metadata. */
export interface ModelConfig {
  architecture: Architecture;
  name: string;
  layers: number;
  dim: number;
  heads: number;
  kvHeads: number;
  headDim: number;
  ffnDim: number;
  vocab: number;
  contextLength: number;
  rmsEps: number;
  ropeBase: number;
  ropeDim: number;
  ropeLayout: RopeLayout;
  /** Linear or YaRN scaling of a context-extended model (`rope.scaling.*`, `rope.scale_linear`), as llama.cpp reads it. */
  ropeScaling: RopeScaling;
  /** The optional bias vectors the file has (qwen2's q/k/v ones among them), as llama.cpp's loader reads them. */
  biases: readonly ModelBias[];
  /** qwen3, gemma3: RMSNorm over each head of q and k before RoPE. */
  qkNorm: boolean;
  /** gemma3: RMSNorm of the attention's and the feed-forward's output before each is added to the residual stream. */
  postNorms: boolean;
  /** The feed-forward's gated activation: silu(gate)·up (llama, qwen) or gelu(gate)·up, gelu's tanh form (gemma3). */
  ffnActivation: GatedActivation;
  /** What the token embedding is multiplied by: 1, or gemma3's sqrt(dim). */
  embeddingScale: number;
  /** What q·k is multiplied by before the softmax: 1/sqrt(headDim), but 1/sqrt(dim/heads) for Gemma 3 27B. */
  attentionScale: number;
  /** gemma3: the local layers attend within a sliding window, the others (global) to the whole sequence. */
  slidingWindow: SlidingWindow | null;
  /**
   * smollm3: every `noRopeLayerStep`-th layer (the last of each step) applies no RoPE to q and k (llama.cpp's
   * n_no_rope_layer_step, which its smollm3 loader sets to 4 and reads from no key); null: every layer does.
   */
  noRopeLayerStep: number | null;
  /** The output projection reuses the token embedding when the file has no `output.weight`. */
  tiedOutput: boolean;
  /** Llama 3 frequency scaling: `rope_freqs.weight` is present (llama only; llama.cpp's qwen loaders refuse it). */
  ropeFreqFactors: boolean;
  /** phi3: q, k and v are one matrix, `attn_qkv.weight` (q's rows, then k's, then v's), split by rows at load. */
  fusedQkv: boolean;
  /** phi3: `ffn_up.weight` holds the gate's rows, then the up projection's (llama.cpp's swiglu halves), split at load. */
  fusedGateUp: boolean;
  /** phi3: LongRoPE's per-pair frequency factors (RopeFactorSets); null where the file has neither set. */
  longRope: LongRope | null;
}

/**
 * Phi-3's LongRoPE as llama.cpp applies it (llama_model::get_rope_factors): per-pair divisors of the RoPE angles,
 * `rope_factors_long.weight` where the context a sequence may reach (n_ctx_seq; here the pool's maxSequenceTokens)
 * exceeds `originalContext` (`rope.scaling.original_context_length`, else the training context), else
 * `rope_factors_short.weight`; either may be absent, and then no factors apply. Its attention factor is the file's
 * `rope.scaling.attn_factor` (ModelConfig.ropeScaling.attnFactor), applied with either set.
 */
export interface LongRope {
  long: boolean;
  short: boolean;
  originalContext: number;
}

/** The LongRoPE factor tensor a model serving sequences of up to `contextTokens` rotates with, or null for none. */
export function longRopeFactorTensor(c: Pick<ModelConfig, 'longRope'>, contextTokens: number): string | null {
  const r = c.longRope;
  if (!r) return null;
  if (contextTokens > r.originalContext) return r.long ? 'rope_factors_long.weight' : null;
  return r.short ? 'rope_factors_short.weight' : null;
}

/**
 * Sliding-window attention as llama.cpp runs gemma3 (LLAMA_SWA_TYPE_STANDARD): in a local layer the query at position
 * p sees the keys at p - size + 1 .. p; every `period`-th layer (the last of each period) is global. Local layers
 * rotate with their own RoPE base and no context scaling (llama.cpp's rope_freq_base_train_swa, freq_scale 1).
 */
export interface SlidingWindow {
  /** Keys a query of a local layer sees, its own included (`attention.sliding_window`). */
  size: number;
  /** Per layer: true where it is local (windowed). */
  local: readonly boolean[];
  /** RoPE base of the local layers (`rope.freq_base_swa`, default 10000). */
  ropeBase: number;
}

/** Whether `layer` of a model attends within its sliding window (null: it sees the whole sequence). */
export function layerWindow(c: Pick<ModelConfig, 'slidingWindow'>, layer: number): number | null {
  return c.slidingWindow?.local[layer] ? c.slidingWindow.size : null;
}

/** Whether `layer` rotates q and k by RoPE: llama.cpp's use_rope = (il + 1) % n_no_rope_layer_step != 0. */
export function layerUsesRope(c: Pick<ModelConfig, 'noRopeLayerStep'>, layer: number): boolean {
  return c.noRopeLayerStep === null || (layer + 1) % c.noRopeLayerStep !== 0;
}

/**
 * Optional biases: of each layer's projections (`blk.N.attn_q.bias` … `blk.N.ffn_down.bias`) and of the output
 * projection (`output.bias`). Which exist is read from block 0; the tensor check holds every block to it.
 */
export type ModelBias = 'q' | 'k' | 'v' | 'o' | 'gate' | 'up' | 'down' | 'output';

/** GGUF tensor names of the biases. */
export function biasTensorName(bias: ModelBias, layer: number): string {
  if (bias === 'output') return 'output.bias';
  const tensor = {
    q: 'attn_q',
    k: 'attn_k',
    v: 'attn_v',
    o: 'attn_output',
    gate: 'ffn_gate',
    up: 'ffn_up',
    down: 'ffn_down',
  };
  return `blk.${layer}.${tensor[bias]}.bias`;
}

/** The optional biases llama.cpp's loader reads per architecture (llama-model.cpp, src/models/*): the rest it refuses. */
const BIASES: Record<Architecture, readonly ModelBias[]> = {
  llama: ['q', 'k', 'v', 'o', 'gate', 'up', 'down'],
  qwen2: ['q', 'k', 'v', 'output'],
  qwen3: ['q', 'k', 'v'],
  gemma3: ['q', 'k', 'v'],
  smollm3: ['q', 'k', 'v'],
  // phi3's create_tensor_qkv reads q/k/v biases only beside separate q/k/v matrices (fused ones are refused below).
  phi3: ['q', 'k', 'v'],
};

/** llama.cpp's rope type per architecture: Llama and SmolLM3 keep adjacent pairs, Qwen, Gemma and Phi-3 rotate halves. */
const ROPE_LAYOUT: Record<Architecture, RopeLayout> = {
  llama: 'normal',
  qwen2: 'neox',
  qwen3: 'neox',
  gemma3: 'neox',
  smollm3: 'normal',
  phi3: 'neox',
};

export function readModelConfig(file: GgufFile): ModelConfig {
  const meta = file.metadata;
  const arch = metaString(meta, 'general.architecture');
  refuseMixtureOfExperts(file, arch);
  if (!SUPPORTED_ARCHITECTURES.includes(arch as Architecture)) {
    throw new UnsupportedModelError(
      `Architecture '${arch}' is not supported; longtab runs ${SUPPORTED_ARCHITECTURES.join(', ')} (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, SmolLM3, Phi-3/3.5/4-mini).`,
      { architecture: arch },
    );
  }
  const architecture = arch as Architecture;
  const tensors = new Map<string, GgufTensorInfo>(file.tensors.map((t) => [t.name, t]));
  const dim = metaNumber(meta, `${arch}.embedding_length`);
  const heads = perLayer(meta, `${arch}.attention.head_count`) ?? metaNumber(meta, `${arch}.attention.head_count`);
  const headDim = metaOptionalNumber(meta, `${arch}.attention.key_length`) ?? dim / heads;
  const embedding = tensors.get('token_embd.weight');
  const tokens = meta['tokenizer.ggml.tokens'];
  const vocab =
    metaOptionalNumber(meta, `${arch}.vocab_size`) ??
    embedding?.shape[1] ??
    (Array.isArray(tokens) ? tokens.length : 0);
  const layers = metaNumber(meta, `${arch}.block_count`);
  const gemma = architecture === 'gemma3';
  const phi3 = architecture === 'phi3';
  const fusedQkv = phi3 && tensors.has('blk.0.attn_qkv.weight');
  const config: ModelConfig = {
    architecture,
    name: typeof meta['general.name'] === 'string' ? (meta['general.name'] as string) : architecture,
    layers,
    dim,
    heads,
    kvHeads: perLayer(meta, `${arch}.attention.head_count_kv`) ?? heads,
    headDim,
    ffnDim: perLayer(meta, `${arch}.feed_forward_length`) ?? metaNumber(meta, `${arch}.feed_forward_length`),
    vocab,
    contextLength: metaOptionalNumber(meta, `${arch}.context_length`) ?? 2048,
    rmsEps: metaOptionalNumber(meta, `${arch}.attention.layer_norm_rms_epsilon`) ?? 1e-5,
    ropeBase: metaOptionalNumber(meta, `${arch}.rope.freq_base`) ?? 10000,
    ropeDim: metaOptionalNumber(meta, `${arch}.rope.dimension_count`) ?? headDim,
    ropeLayout: ROPE_LAYOUT[architecture],
    ropeScaling: readRopeScaling(meta, arch),
    biases: BIASES[architecture].filter((b) => !(fusedQkv && 'qkv'.includes(b)) && tensors.has(biasTensorName(b, 0))),
    qkNorm: architecture === 'qwen3' || gemma,
    postNorms: gemma,
    ffnActivation: gemma ? 'geglu' : 'swiglu',
    embeddingScale: gemma ? Math.sqrt(dim) : 1,
    // llama.cpp takes Gemma 3 27B (62 layers) by its layer count, whose queries are scaled by its dim per head.
    attentionScale: 1 / Math.sqrt(gemma && layers === 62 ? dim / heads : headDim),
    slidingWindow: null,
    noRopeLayerStep: architecture === 'smollm3' ? 4 : null,
    tiedOutput: !tensors.has('output.weight'),
    ropeFreqFactors: architecture === 'llama' && tensors.has('rope_freqs.weight'),
    fusedQkv,
    fusedGateUp: phi3,
    longRope: phi3 ? readLongRope(meta, arch, tensors) : null,
  };
  checkShape(config, file.tensors.length);
  // After checkShape: it builds a flag per layer.
  if (gemma) config.slidingWindow = readSlidingWindow(meta, arch, layers);
  checkValues(config, arch);
  refuseUnusedMetadata(meta, config);
  return config;
}

/**
 * Tensors only a mixture-of-experts model has (llama.cpp's names): the experts' stacked or per-expert FFN matrices,
 * shared experts, the router and its bias.
 */
const EXPERT_TENSOR =
  /^blk\.\d+\.(ffn_\w*(exps|shexp)|ffn_gate_inp\w*|exp_probs_b\w*|ffn_(gate|up|down)\.\d+)\.(weight|bias)$/;

/** A tensor name that only a mixture-of-experts model has. */
export function isExpertTensor(name: string): boolean {
  return EXPERT_TENSOR.test(name);
}

/**
 * A mixture-of-experts model (Mixtral in llama files, Qwen2/3-MoE, DeepSeek, OLMoE …), told by its expert count or its
 * expert tensors, whatever the architecture: refused as such from the header, before any other check could call its
 * unusual shape damage.
 */
function refuseMixtureOfExperts(file: GgufFile, arch: string): void {
  const key = `${arch}.expert_count`;
  const count = file.metadata[key];
  const counts = (Array.isArray(count) ? count : [count]).map((v) => (typeof v === 'bigint' ? Number(v) : v));
  const experts = counts.find((v): v is number => typeof v === 'number' && v > 0);
  const tensor = experts === undefined ? file.tensors.find((t) => isExpertTensor(t.name))?.name : undefined;
  if (experts === undefined && tensor === undefined) return;
  const evidence = experts !== undefined ? `${key} = ${experts}` : `it has tensor '${tensor}'`;
  throw new UnsupportedModelError(
    `The model is a mixture-of-experts model (${arch}, ${evidence}); longtab runs dense models only (${SUPPORTED_ARCHITECTURES.join(', ')} without experts). Pick a dense model of a similar size.`,
    experts !== undefined ? { key, value: experts, architecture: arch } : { tensor, architecture: arch },
  );
}

/**
 * Heads the attention kernels do not run (kernels/attention.wgsl.ts attentionRunsHeadDim: up to 256 dims, Falcon3's
 * and Gemma's, in multiples of 8): refused from the header, not by a kernel after every weight is uploaded. Called by
 * validateTensors once the tensors agree with the metadata, so a file whose head size is damage is called damaged.
 */
export function refuseUnsupportedHeads(meta: GgufMetadata, c: ModelConfig): void {
  if (attentionRunsHeadDim(c.headDim)) return;
  const arch = c.architecture;
  const key = `${arch}.attention.key_length`;
  const from = Object.hasOwn(meta, key) ? key : `${arch}.embedding_length ÷ ${arch}.attention.head_count`;
  throw new UnsupportedModelError(
    `The model's attention heads have ${c.headDim} dims (${from}); longtab's attention kernels run heads of up to ${ATTENTION_MAX_HEAD_DIM} dims, in multiples of 8. Models with ${c.headDim}-dim heads are not supported yet.`,
    { key, headDim: c.headDim, maxHeadDim: ATTENTION_MAX_HEAD_DIM },
  );
}

/**
 * A hyperparameter that llama.cpp also reads per layer (an array, one value a layer): its one value where every layer
 * has the same (as converters write it for uniform models), undefined where the key is absent. Layers that differ
 * (OpenELM-style models) need a forward pass with per-layer shapes: UnsupportedModelError naming the key.
 */
function perLayer(meta: GgufMetadata, key: string): number | undefined {
  const value = meta[key];
  if (!Array.isArray(value)) return metaOptionalNumber(meta, key);
  const values = value.map((v) => (typeof v === 'bigint' ? Number(v) : v));
  const first = values[0];
  if (values.length === 0 || typeof first !== 'number' || values.some((v) => v !== first)) {
    throw new UnsupportedModelError(
      `The model sets ${key} per layer (${values.slice(0, 8).join(', ')}${values.length > 8 ? ', …' : ''}); longtab runs models whose layers all have the same shape.`,
      { key },
    );
  }
  return first;
}

/**
 * Values the forward pass divides by, takes the square root of or pairs up: a file whose values make no model is
 * damaged (CorruptModelFileError naming the key), found here rather than as NaN logits or a kernel's error.
 */
function checkValues(c: ModelConfig, arch: string): void {
  const fail = (key: string, value: number, rule: string) => {
    throw new CorruptModelFileError(
      `The model's ${arch}.${key} is ${value}, which ${rule}: the file is damaged or was made by a broken converter.`,
      { key: `${arch}.${key}`, value },
    );
  };
  if (!(Number.isFinite(c.rmsEps) && c.rmsEps > 0))
    fail('attention.layer_norm_rms_epsilon', c.rmsEps, 'must be a positive number');
  if (!(Number.isFinite(c.ropeBase) && c.ropeBase > 0)) fail('rope.freq_base', c.ropeBase, 'must be a positive number');
  if (c.ropeDim % 2 !== 0) fail('rope.dimension_count', c.ropeDim, 'must be even (RoPE rotates pairs of dims)');
  if (c.heads % c.kvHeads !== 0) {
    fail('attention.head_count_kv', c.kvHeads, `must divide the ${c.heads} query heads (each KV head serves a group)`);
  }
}

/**
 * gemma3's sliding window as llama.cpp reads it (src/models/gemma3.cpp): `attention.sliding_window` (0 or absent: every
 * layer global), every `attention.sliding_window_pattern`-th layer global (default 6; 0 makes every layer local),
 * `rope.freq_base_swa` the local layers' RoPE base (default 10000). llama.cpp ignores a pattern stored as an array
 * (per-layer flags, as Gemma 3n files have) and takes 6: refused here rather than guessed.
 */
function readSlidingWindow(meta: GgufMetadata, arch: string, layers: number): SlidingWindow | null {
  const size = metaOptionalNumber(meta, `${arch}.attention.sliding_window`) ?? 0;
  const patternKey = `${arch}.attention.sliding_window_pattern`;
  if (Array.isArray(meta[patternKey])) {
    throw new UnsupportedModelError(
      `The model sets ${patternKey} per layer (an array); longtab runs ${arch} models whose sliding-window pattern is one period (every Nth layer global).`,
      { key: patternKey },
    );
  }
  const period = metaOptionalNumber(meta, patternKey) ?? 6;
  const ropeBase = metaOptionalNumber(meta, `${arch}.rope.freq_base_swa`) ?? 10000;
  for (const [key, value] of [
    ['attention.sliding_window', size],
    ['attention.sliding_window_pattern', period],
  ] as const) {
    if (!Number.isInteger(value) || value < 0) {
      throw new CorruptModelFileError(
        `The model's ${arch}.${key} is ${value}, which must be a whole number: the file is damaged. Download it again.`,
        { key: `${arch}.${key}`, value },
      );
    }
  }
  if (!(Number.isFinite(ropeBase) && ropeBase > 0)) {
    throw new CorruptModelFileError(
      `The model's ${arch}.rope.freq_base_swa is ${ropeBase}, which must be a positive number: the file is damaged.`,
      { key: `${arch}.rope.freq_base_swa`, value: ropeBase },
    );
  }
  if (size === 0) return null;
  const local = Array.from({ length: layers }, (_, l) => period === 0 || l % period < period - 1);
  return local.some(Boolean) ? { size, local, ropeBase } : null;
}

/** phi3's LongRoPE factor sets and the context that chooses between them (LongRope). */
function readLongRope(meta: GgufMetadata, arch: string, tensors: ReadonlyMap<string, GgufTensorInfo>): LongRope | null {
  const long = tensors.has('rope_factors_long.weight');
  const short = tensors.has('rope_factors_short.weight');
  if (!long && !short) return null;
  const originalContext =
    metaOptionalNumber(meta, `${arch}.rope.scaling.original_context_length`) ??
    metaOptionalNumber(meta, `${arch}.context_length`) ??
    2048;
  return { long, short, originalContext };
}

/**
 * RoPE scaling as llama.cpp reads it (llama-model.cpp load_hparams, llama-context.cpp): the type defaults to linear;
 * the factor is `rope.scaling.factor`, else the older `rope.scale_linear`, and 0 or absent means none; YaRN's original
 * context defaults to the training context; `rope.scaling.attn_factor` scales cos and sin in every mode. llama.cpp
 * reads no YaRN beta keys for these architectures and uses 32 and 1.
 */
function readRopeScaling(meta: GgufMetadata, arch: string): RopeScaling {
  const typeKey = `${arch}.rope.scaling.type`;
  const type = metaOptionalString(meta, typeKey) ?? 'linear';
  if (type !== 'none' && type !== 'linear' && type !== 'yarn') {
    throw new UnsupportedModelError(
      `The model uses RoPE scaling '${type}' (${typeKey}); longtab applies none, linear and yarn scaling to ${arch} models.`,
      { key: typeKey, value: type },
    );
  }
  const factorKey =
    metaOptionalNumber(meta, `${arch}.rope.scaling.factor`) !== undefined ? 'rope.scaling.factor' : 'rope.scale_linear';
  const factor = metaOptionalNumber(meta, `${arch}.${factorKey}`) ?? 0;
  const attnFactor = metaOptionalNumber(meta, `${arch}.rope.scaling.attn_factor`) ?? 1;
  const originalContext =
    metaOptionalNumber(meta, `${arch}.rope.scaling.original_context_length`) ??
    metaOptionalNumber(meta, `${arch}.context_length`) ??
    0;
  for (const [key, value] of [
    [factorKey, factor],
    ['rope.scaling.attn_factor', attnFactor],
    ['rope.scaling.original_context_length', originalContext],
  ] as const) {
    if (
      !Number.isFinite(value) ||
      value < 0 ||
      (key === 'rope.scaling.original_context_length' && type === 'yarn' && value < 1)
    ) {
      throw new CorruptModelFileError(
        `The model's ${arch}.${key} is ${value}, which no RoPE scaling can use: the file is damaged. Download it again.`,
        { key: `${arch}.${key}`, value },
      );
    }
  }
  if (type === 'none' || (factor === 0 && type === 'linear')) return { ...NO_ROPE_SCALING, attnFactor };
  return { ...NO_ROPE_SCALING, type, factor: factor === 0 ? 1 : factor, originalContext, attnFactor };
}

/** Namespaces the forward pass never reads: provenance, the tokenizer's own keys, shard bookkeeping, longtab's own. */
const NEUTRAL_NAMESPACES = ['general.', 'tokenizer.', 'quantize.', 'split.', 'longtab.'];

/**
 * Keys under `<arch>.` that readModelConfig reads (every `<arch>.` key llama.cpp reads for llama, qwen2, qwen3 and
 * smollm3 that longtab implements), with nothing to check beyond what readModelConfig checks; ARCH_READ_KEYS adds an
 * architecture's own.
 */
const READ_KEYS = new Set([
  'vocab_size',
  'context_length',
  'embedding_length',
  'block_count',
  'feed_forward_length',
  'attention.head_count',
  'attention.head_count_kv',
  'attention.key_length',
  'attention.layer_norm_rms_epsilon',
  'rope.dimension_count',
  'rope.freq_base',
  'rope.scaling.type',
  'rope.scaling.factor',
  'rope.scale_linear',
  'rope.scaling.attn_factor',
  'rope.scaling.original_context_length',
]);

/** Keys only some architectures' loaders read (llama.cpp's load_arch_hparams), read by readModelConfig for them. */
const ARCH_READ_KEYS: Partial<Record<Architecture, ReadonlySet<string>>> = {
  gemma3: new Set(['attention.sliding_window', 'attention.sliding_window_pattern', 'rope.freq_base_swa']),
};

type NeutralValue = { holds(value: GgufValue, c: ModelConfig): boolean; assumed(c: ModelConfig): string };

/**
 * An architecture's own neutral keys (see NEUTRAL_VALUES). gemma3: llama.cpp reads a final logit soft-cap (Gemma 3
 * has none: its converter writes the key only where the Hugging Face config sets one), and, for every architecture,
 * head and RoPE sizes of the sliding-window layers, which its gemma3 graph never uses but a tensor shape would.
 */
const ARCH_NEUTRAL_VALUES: Partial<Record<Architecture, Record<string, NeutralValue>>> = {
  gemma3: {
    final_logit_softcapping: { holds: (v) => v === 0, assumed: () => '0 (no soft-capping of the logits)' },
    'attention.key_length_swa': { holds: (v, c) => v === c.headDim, assumed: (c) => `${c.headDim}, the key length` },
    'attention.value_length_swa': { holds: (v, c) => v === c.headDim, assumed: (c) => `${c.headDim}, the key length` },
    'rope.dimension_count_swa': {
      holds: (v, c) => v === c.ropeDim,
      assumed: (c) => `${c.ropeDim}, the rotated dims of the global layers`,
    },
  },
  // llama.cpp's phi3 loader reads the sliding window and then turns it off whatever its value (src/models/phi3.cpp:
  // "Phi SWA is currently disabled"), attending to the whole sequence; the converter writes 0 for Phi-4.
  phi3: {
    'attention.sliding_window': {
      holds: () => true,
      assumed: () => 'any (llama.cpp attends to the whole sequence in phi3 models)',
    },
  },
};

/**
 * Keys under `<arch>.` that change nothing while they hold the value the forward pass assumes, and what that value
 * is: llama.cpp reads some of them for every architecture (MoE counts, causal attention) and ignores others for these
 * three (the YaRN tuning keys a newer converter writes from the Hugging Face config) — a file that sets them otherwise
 * is refused rather than run one way when its model was trained another.
 */
const NEUTRAL_VALUES: Record<string, NeutralValue> = {
  // Older converters' note that q and k are permuted to GGUF's layout, as every llama GGUF file is.
  tensor_data_layout: { holds: () => true, assumed: () => 'any' },
  // Stored by llama.cpp, used for nothing.
  'rope.scaling.finetuned': { holds: () => true, assumed: () => 'any' },
  'attention.value_length': { holds: (v, c) => v === c.headDim, assumed: (c) => `${c.headDim}, the key length` },
  'attention.causal': { holds: (v) => v === true, assumed: () => 'true' },
  expert_count: { holds: (v) => v === 0, assumed: () => '0 (longtab runs no mixture-of-experts model)' },
  expert_used_count: { holds: (v) => v === 0, assumed: () => '0 (longtab runs no mixture-of-experts model)' },
  pooling_type: {
    holds: (v) => v === 0,
    assumed: () => '0 (no pooling: longtab generates text, it makes no embeddings)',
  },
  'rope.scaling.yarn_beta_fast': {
    holds: (v, c) => c.ropeScaling.type !== 'yarn' || v === c.ropeScaling.betaFast,
    assumed: (c) => `${c.ropeScaling.betaFast}, llama.cpp's value for ${c.architecture}`,
  },
  'rope.scaling.yarn_beta_slow': {
    holds: (v, c) => c.ropeScaling.type !== 'yarn' || v === c.ropeScaling.betaSlow,
    assumed: (c) => `${c.ropeScaling.betaSlow}, llama.cpp's value for ${c.architecture}`,
  },
  'rope.scaling.yarn_ext_factor': {
    holds: (v, c) => v === (c.ropeScaling.type === 'yarn' ? 1 : 0),
    assumed: (c) => `${c.ropeScaling.type === 'yarn' ? 1 : 0}, llama.cpp's value for ${c.ropeScaling.type} scaling`,
  },
  'rope.scaling.yarn_attn_factor': {
    // Transformers' attention_factor replaces YaRN's 1 + 0.1·ln(factor), which llama.cpp always uses here.
    holds: (v, c) =>
      typeof v === 'number' &&
      c.ropeScaling.type === 'yarn' &&
      Math.abs(v - (c.ropeScaling.factor > 1 ? 1 + 0.1 * Math.log(c.ropeScaling.factor) : 1)) < 1e-6,
    assumed: (c) =>
      c.ropeScaling.type === 'yarn'
        ? `${c.ropeScaling.factor > 1 ? 1 + 0.1 * Math.log(c.ropeScaling.factor) : 1}, YaRN's own magnitude for factor ${c.ropeScaling.factor}`
        : 'absent without YaRN scaling',
  },
  'rope.scaling.yarn_log_multiplier': { holds: (v) => v === 0, assumed: () => '0' },
  'rope.scaling.alpha': { holds: (v) => v === 0, assumed: () => '0' },
};

/**
 * Every metadata key must be one the forward pass reads, or neutral (NEUTRAL_NAMESPACES, NEUTRAL_VALUES): a key it
 * ignored would leave the model answering as if the key were absent, without a word. Checked from the metadata, before
 * any tensor is read.
 */
function refuseUnusedMetadata(meta: GgufMetadata, c: ModelConfig): void {
  const prefix = `${c.architecture}.`;
  for (const [key, value] of Object.entries(meta)) {
    if (NEUTRAL_NAMESPACES.some((n) => key.startsWith(n))) continue;
    const name = key.startsWith(prefix) ? key.slice(prefix.length) : null;
    if (name !== null && (READ_KEYS.has(name) || ARCH_READ_KEYS[c.architecture]?.has(name))) continue;
    const own = ARCH_NEUTRAL_VALUES[c.architecture] ?? {};
    const neutral =
      name === null
        ? undefined
        : Object.hasOwn(own, name)
          ? own[name]
          : Object.hasOwn(NEUTRAL_VALUES, name)
            ? NEUTRAL_VALUES[name]
            : undefined;
    if (neutral?.holds(typeof value === 'bigint' ? Number(value) : value, c)) continue;
    const shown = Array.isArray(value) ? `an array of ${value.length}` : String(value).slice(0, 60);
    throw new UnsupportedModelError(
      neutral
        ? `The model sets ${key} = ${shown}; longtab runs ${c.architecture} models only with ${neutral.assumed(c)}, so it refuses this file rather than answer wrong.`
        : `The model has metadata ${key} (${shown}), which longtab's ${c.architecture} forward pass does not use: it would answer as if the key were absent, so it refuses the file. If the key is known to change nothing, remove it (llama.cpp's gguf_new_metadata.py --remove-metadata ${key}).`,
      { key, value: typeof value === 'bigint' ? value.toString() : Array.isArray(value) ? value.length : value },
    );
  }
}

/**
 * Hyperparameters that no tensor table could back (found by fuzzing the loader): a block count of 10^9 would build a
 * 10^10-entry list of expected tensors before any shape check ran. Each layer needs at least 9 tensors, 6 where
 * q/k/v and gate/up are fused (phi3).
 */
function checkShape(c: ModelConfig, tensorCount: number): void {
  const perLayer = 9 - (c.fusedQkv ? 2 : 0) - (c.fusedGateUp ? 1 : 0);
  const sizes: Array<[string, number, number]> = [
    ['block_count', c.layers, Math.floor(tensorCount / perLayer)],
    ['embedding_length', c.dim, 1 << 20],
    ['attention.head_count', c.heads, 1 << 16],
    ['attention.head_count_kv', c.kvHeads, c.heads],
    ['head dimension', c.headDim, 1 << 16],
    ['feed_forward_length', c.ffnDim, 1 << 24],
    ['vocab size', c.vocab, 1 << 24],
    ['context_length', c.contextLength, 2 ** 40],
    // rope_freqs.ones has ropeDim/2 floats: a fuzzed 10^9 allocated gigabytes.
    ['rope.dimension_count', c.ropeDim, c.headDim],
  ];
  for (const [name, value, max] of sizes) {
    if (!Number.isInteger(value) || value < 1 || value > max) {
      throw new CorruptModelFileError(
        `The model's ${name} is ${value}, which its ${tensorCount} tensors cannot back (expected an integer in 1..${max}): the file is damaged. Download it again.`,
        { field: name, value },
      );
    }
  }
}
