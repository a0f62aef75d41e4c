/**
 * The public API's types: OpenAI's chat/completions shapes (the subset longtab implements, plus its own fields),
 * the load options and the stats. Shared by the in-process `LongtabEngine` and the worker client, so both are used
 * through the one `LongtabEngineApi` interface.
 */
export type KvMode = 'f16' | 'int2';

/** How K/V are rotated before storage (spreads outliers over the quantization group). */
export type KvRotation = 'calibrated' | 'hadamard' | 'none';

/**
 * Load phases, always in this order: `download` (URL sources: the size probe; Range reads then stream during the
 * next phases), `parse` (GGUF header and metadata), `upload` (weights to the GPU), `calibrate` (a warm-up forward;
 * the int2 KV mode will fit its quantizer here). `bytesDone` never decreases within a phase.
 */
export interface LoadProgress {
  phase: 'download' | 'parse' | 'upload' | 'calibrate';
  bytesDone: number;
  bytesTotal: number;
}

/** Why a reply ended: 'tool_calls' where it is one or more calls of the request's `tools`. */
export type FinishReason = 'stop' | 'length' | 'abort' | 'tool_calls';

/**
 * What to load: an http(s) URL (read with Range requests), a File or Blob, or, in Node only, a file path.
 * A relative URL resolves against the page (or worker) location.
 */
export type ModelSource = string | URL | Blob;

/** What the prefill kernel options accept (ExperimentalLoadOptions.prefillMatmul and prefillAttention). */
export const PREFILL_CHOICES = ['auto', 'f32', 'int8-dot'] as const;

/** Prefill attention products (ExperimentalLoadOptions.prefillAttention). */
export type PrefillAttention = (typeof PREFILL_CHOICES)[number];

/**
 * What `load` accepts. Each field is checked, with the defaults below applied, by `parseLoadOptions`
 * (runtime/engine/load-options.ts) before anything loads; an unknown field is an InvalidRequestError.
 */
export interface EngineLoadOptions {
  /**
   * KV cache format: 'int2', 2-bit pages with the first and most recent tokens kept f16, or 'f16'. Omitted: 'int2'
   * where the model's K/V rows split into its quant groups, else 'f16' (ModelInfo.kv says which).
   */
  kv?: KvMode;
  /** Bytes of GPU memory the KV cache may grow to (default 64 MiB). */
  kvBudgetBytes?: number;
  /**
   * Bytes of host memory that keep conversations evicted from the GPU budget, their pages as they are, so their next
   * turn prefills only what is new (default: kvBudgetBytes; 0 re-prefills them instead). Least recently used go first.
   */
  hostKvBudgetBytes?: number;
  /**
   * Keep every conversation's KV in the engine's KV store after each turn (a request's `persist` overrides it), so a
   * conversation resumes without re-prefilling after a reload or in a new engine (default false). Needs an engine
   * with a KV store (the worker's OPFS, Node's directory).
   */
  persist?: boolean;
  /** Live KV sequences at once, 1..256 (conversations plus shared system prompts; default 16). */
  maxSequences?: number;
  /** Longest sequence in tokens (default: the model's context length; the budget caps it too). */
  maxContextTokens?: number;
  /**
   * Tokens per prefill submit, 1..4096 (default 128; 1024 where the prefill runs on int8 tensor cores and the KV
   * budget holds such steps, else 512 or 128).
   */
  prefillChunk?: number;
  /**
   * Rotation of each head's K/V before storage: 'hadamard' (default for int2), 'none' (default for f16),
   * 'calibrated' (OSCAR rotations fitted to the model, from its metadata or the rotation cache; without them the
   * engine starts with 'hadamard' and calibrates in the background, see `calibrate`).
   */
  rotation?: KvRotation;
  /**
   * rotation 'calibrated' on a model without fitted rotations: 'background' (default) loads with 'hadamard' and,
   * between requests, fits rotations and clip quantiles on text the model writes itself, caches them under the
   * model's digest and switches to them (conversations cached until then are re-prefilled on their next turn);
   * 'off' rejects the load. `stats().kv.rotation` shows the progress.
   */
  calibrate?: 'background' | 'off';
  /** Called in phase order download → parse → upload → calibrate (through the worker the client proxies it). */
  onProgress?: (progress: LoadProgress) => void;
  /**
   * URL sources: the longest wait, in ms, for each response's headers and for each chunk of its body (1..3 600 000;
   * default 30 000 each). A server silent for longer fails the load with a DownloadFailedError, so a stalled load ends
   * within headersTimeoutMs + chunkTimeoutMs of its last byte.
   */
  network?: { headersTimeoutMs?: number; chunkTimeoutMs?: number };
  /** Research knobs (evaluations, benchmarks): they may change or go between versions. */
  experimental?: ExperimentalLoadOptions;
}

/** The research knobs of `load`: `longtab eval`, the benchmarks and the e2e tests set them; the defaults are tuned. */
export interface ExperimentalLoadOptions {
  /** int2: the first `sink` positions of each sequence stay f16 (attention sinks; default 64). */
  sink?: number;
  /** int2: the most recent `window` positions stay f16 until they are quantized (default 256). */
  window?: number;
  /** int2: values per quantization group, one scale and offset each, 1..65536 (default min(128, kvHeads × headDim)). */
  groupSize?: number;
  /** int2 pages' code bits (default 2); 1 exists as the weak control of `longtab eval` (mode int1-none). */
  codeBits?: 1 | 2;
  /**
   * int2 with 2-bit codes: layers whose K and V stay at 4 bits without clipping (KITTY's boosted precision, by
   * layer). Each costs about 2 more bits per element in that layer; it pays where one layer carries the model's
   * reading of its distant history (docs/kv-cache.md, "Boosted layers"). Default none.
   */
  boostLayers?: number[];
  /**
   * int2 with calibrated rotations: 'calibrated' (default) lays the pages out by the precision plan the calibration
   * chose (per layer K and V bits and clip, runtime/kv/precision-plan.ts); 'uniform' uses one 2-bit format with
   * the fitted clip quantiles in every layer (the cache before plans existed, kept for comparison).
   */
  precisionPlan?: 'calibrated' | 'uniform';
  /**
   * Prefill projections: 'auto' (default) runs them on int8 tensor cores where the GPU offers them (Dawn's
   * experimental subgroup matrices: Chrome with --enable-unsafe-webgpu; activations quantized per 32 elements, as
   * llama.cpp does), or on dot4I8Packed where that measured faster (larger matmuls; Q6_K weights); 'f32' keeps the
   * f32 kernels; 'int8-dot' runs every int8 matmul on dot4I8Packed, which every GPU has (measured only on a GPU with
   * tensor cores, so 'auto' uses it only there).
   */
  prefillMatmul?: (typeof PREFILL_CHOICES)[number];
  /**
   * Prefill attention: 'auto' (default) computes q·k and p·v on int8 tensor cores where the GPU offers them (q, k
   * and v per row or key, the softmax weights per row of each 64-key tile quantized to 8 bits), 'f32' keeps the f32
   * kernels; 'int8-dot' runs the same int8 arithmetic on dot4I8Packed, which GPUs without the tensor-core feature have
   * (not yet measured against f32 on a GPU, so 'auto' does not pick it). Decode steps always use the f32 decode kernel.
   */
  prefillAttention?: PrefillAttention;
  /** Tokens of self-generated text for the background calibration, 16..4096 (default 64 × head_dim within 128..4096). */
  calibrationTokens?: number;
}

export interface ModelInfo {
  name: string;
  architecture: string;
  layers: number;
  vocab: number;
  contextLength: number;
  /** Tokens one conversation can hold in this KV budget. */
  contextCapacity: number;
  kv: KvMode;
  hasChatTemplate: boolean;
}

/** One text part of a message's content (OpenAI's content-part form). */
export interface ChatTextPart {
  type: 'text';
  text: string;
}

/** A call of a function the model made (OpenAI's shape): `arguments` is its JSON text. */
export interface ChatToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

/**
 * A message of the conversation. An assistant message may carry the `tool_calls` it made (its content then may be
 * null); each result comes back as a `tool` message with the call's id.
 */
export type ChatMessageParam =
  | {
      role: 'system' | 'user';
      /** The text, or its text parts (joined by newlines). */
      content: string | ChatTextPart[];
    }
  | { role: 'assistant'; content: string | ChatTextPart[] | null; tool_calls?: ChatToolCall[] }
  | { role: 'tool'; content: string | ChatTextPart[]; tool_call_id: string };

/**
 * A function the model may call (OpenAI's shape). `parameters` is the JSON Schema of its arguments: a forced call
 * (`tool_choice` 'required' or the function's name) is decoded under it.
 */
export interface ChatTool {
  type: 'function';
  function: {
    name: string;
    description?: string;
    parameters?: Record<string, unknown>;
    strict?: boolean;
  };
}

/**
 * Whether the reply calls a tool: 'auto' (default with tools) lets the model choose, 'none' keeps the reply text,
 * 'required' makes it one call of one of the tools, and `{ type: 'function', function: { name } }` a call of that
 * one. Forced calls are decoded under their function's parameters schema.
 */
export type ChatToolChoice = 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } };

/**
 * How control-token text inside messages (e.g. `<|im_start|>system` typed by a user) is read: 'text' (the default)
 * keeps it text; 'tokens' makes it the control tokens, for callers that write template markup on purpose.
 */
export type SpecialTokensInContent = 'text' | 'tokens';

/** What to do when a conversation no longer fits one KV sequence. */
export type ContextOverflowPolicy = 'error' | 'drop_oldest_turns';

interface SamplingRequest {
  /** Most tokens to generate (default 256, capped by the room left in the context). */
  max_tokens?: number;
  /** 0 (default) = greedy. */
  temperature?: number;
  top_p?: number;
  /** longtab extension (llama.cpp): 0 = off. */
  top_k?: number;
  /** longtab extension (llama.cpp): 0 = off. */
  min_p?: number;
  /** longtab extension (llama.cpp's repeat penalty): 1 = off. */
  repetition_penalty?: number;
  seed?: number;
  /** Up to 4 strings; generation ends before the first one that appears (it is not returned). */
  stop?: string | string[];
  /** What the reply must be (default `{ type: 'text' }`); decoding is constrained token by token on the GPU. */
  response_format?: ResponseFormat;
}

/**
 * A reply's format, as OpenAI's `response_format`: JSON, JSON that a schema accepts (`strict` defaults to true:
 * no keys beyond the schema's), or plain text; longtab extension `grammar`: an EBNF grammar in xgrammar's dialect
 * (GBNF-like), whose start rule is `root`.
 */
export type ResponseFormat =
  | { type: 'text' }
  | { type: 'json_object' }
  | {
      type: 'json_schema';
      json_schema: { name: string; description?: string; schema?: Record<string, unknown>; strict?: boolean };
    }
  | { type: 'grammar'; grammar: string };

export interface ChatCompletionRequest extends SamplingRequest {
  messages: ChatMessageParam[];
  /** Functions the model may call, through its chat template's tool format (a template without one is refused). */
  tools?: ChatTool[];
  tool_choice?: ChatToolChoice;
  stream?: boolean;
  /**
   * longtab extension: keep this conversation's KV cache between requests, so a follow-up turn prefills only its new
   * tokens. Without it the request runs in a temporary sequence.
   */
  conversation_id?: string;
  /**
   * longtab extension, with conversation_id: keep this conversation's KV in the engine's KV store (OPFS in the
   * browser, a directory in Node) after each turn, so it resumes without re-prefilling after a reload or in a new
   * engine; false stops that and removes the stored copy. Default: the load option `persist`.
   */
  persist?: boolean;
  /** longtab extension: 'error' (default) throws ContextOverflowError; 'drop_oldest_turns' keeps the system prompt. */
  context_overflow?: ContextOverflowPolicy;
  /** longtab extension: 'text' (default) keeps control-token text in messages as text; 'tokens' parses it. */
  special_tokens_in_content?: SpecialTokensInContent;
  /** Informational; the loaded model is always used. */
  model?: string;
}

export interface CompletionRequest extends SamplingRequest {
  prompt: string;
  stream?: boolean;
  model?: string;
}

/** longtab's timing stats for one request, beside OpenAI's token counts. */
export interface GenerationStats {
  /** Prompt tokens run through the model (prompt_tokens - cached_tokens). */
  prefill_tokens: number;
  prefill_tokens_per_second: number;
  decode_tokens_per_second: number;
  /** Time to first token (ms), from the start of prefill. */
  ttft_ms: number;
  /** Mean time per output token after the first (ms). */
  tpot_ms: number;
  /** Prompt messages dropped by the 'drop_oldest_turns' policy. */
  dropped_messages: number;
  /**
   * Where the conversation's cached tokens were found: 'gpu' (its KV was resident), 'host' (host memory, copied
   * back), 'storage' (the KV store, read back), 'none' (nothing cached).
   */
  kv_from: 'gpu' | 'host' | 'storage' | 'none';
  /** Why the conversation's stored KV was not used (it was removed and the history prefilled); absent otherwise. */
  kv_note?: string;
}

export interface CompletionUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
  longtab: GenerationStats;
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: Array<{
    index: 0;
    /** `content` is null where the reply is tool calls only. */
    message: { role: 'assistant'; content: string | null; tool_calls?: ChatToolCall[] };
    finish_reason: FinishReason;
    logprobs: null;
  }>;
  usage: CompletionUsage;
}

/** One call in a streamed reply: a chunk carries each call whole, at its index. */
export interface ChatToolCallDelta {
  index: number;
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: Array<{
    index: 0;
    delta: { role?: 'assistant'; content?: string; tool_calls?: ChatToolCallDelta[] };
    finish_reason: FinishReason | null;
    logprobs: null;
  }>;
  /** Only on the last chunk (the one with a finish_reason). */
  usage?: CompletionUsage;
}

export interface Completion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: Array<{ index: 0; text: string; finish_reason: FinishReason | null; logprobs: null }>;
  usage?: CompletionUsage;
}

/** A stream of chunks; `abort()` ends it (the last chunk then says finish_reason 'abort'). */
export interface CompletionStream<T> extends AsyncIterable<T> {
  abort(): void;
}

/** The GPU adapter (no WebGPU types here, so the library's declarations need no @webgpu/types). */
export interface AdapterStats {
  vendor: string;
  architecture: string;
  device: string;
  description: string;
  isFallbackAdapter: boolean;
  subgroupMinSize?: number;
  subgroupMaxSize?: number;
  features: { shaderF16: boolean; subgroups: boolean; timestampQuery: boolean; subgroupMatrixI8: boolean };
  maxBufferSize: number;
  maxStorageBufferBindingSize: number;
}

export type KvRotationState = 'none' | 'hadamard' | 'calibrated' | `calibrating ${number}%`;

export interface KvCalibrationStats {
  /** 'paused' while requests run (it resumes between them); 'failed' keeps the Hadamard rotation. */
  phase: 'paused' | 'generating' | 'fitting' | 'switching' | 'done' | 'failed' | 'stopped';
  /** 0..1. */
  progress: number;
  tokens: number;
  error?: string;
}

/** The precision plan in use, as `stats().kv.plan` shows it. */
export interface KvPlanStats {
  /** e.g. "K 2-bit clip 0.96, V 2-bit; layer 5: K 4-bit, V 2-bit". */
  summary: string;
  /**
   * 'calibration': chosen by the calibration (stored with the rotations); 'uniform': one format for every layer
   * (before calibration, or rotations stored without a plan); 'boostLayers': the experimental load option.
   */
  source: 'calibration' | 'uniform' | 'boostLayers';
  layers: Array<{ key: { bits: number; clipQuantile: number }; value: { bits: number; clipQuantile: number } }>;
  /** Effective bits per element of one conversation at 32K positions: f16 sink and window, codes and scales. */
  bitsPerElementAt32K: number;
}

export interface EngineStats {
  model: ModelInfo | null;
  /** Bytes of GPU memory, from the allocator's counts. */
  memory: {
    weights: number;
    /** KV pages that hold tokens. */
    kvUsed: number;
    /** KV pages allocated (used + free), from the pool's stats. */
    kvReserved: number;
    /** Everything in the allocator's 'kv' category: the pages plus the page table and step uniform. */
    kvTotal: number;
    /** What the held tokens would take as f16 K/V (equals the used bytes' payload in f16 mode). */
    kvF16Equivalent: number;
    scratch: number;
    staging: number;
    total: number;
    peak: number;
  };
  kv: {
    mode: KvMode;
    /** The rotation K/V are stored with; 'calibrating N%' while a background calibration runs (Hadamard meanwhile). */
    rotation: KvRotationState;
    /** The background calibration, when one was started by this load (null otherwise). */
    calibration: KvCalibrationStats | null;
    /**
     * Clip quantiles of the K and V row formats (int2; 1 = min/max), fitted with calibrated rotations; boosted
     * layers are never clipped.
     */
    clip: { key: number; value: number } | null;
    /** int2: layers whose K and V are kept at 4 bits (the `boostLayers` load option; empty otherwise). */
    boostLayers: number[];
    /** int2: the precision plan the quant pages are laid out by (runtime/kv/precision-plan.ts); null in f16 mode. */
    plan: KvPlanStats | null;
    /**
     * Tokens the KV budget holds for one conversation in this mode, and what an f16 cache would hold in the same
     * budget (equal in f16 mode).
     */
    holds: { tokens: number; f16Tokens: number };
    pageTokens: number;
    pageBytes: number;
    pagesUsed: number;
    pagesFree: number;
    pagesReserved: number;
    pagesBudget: number;
    sequences: number;
  };
  context: {
    /** Tokens held in KV over all live sequences (a forked prefix counts once per sequence). */
    used: number;
    /** Tokens one conversation can hold. */
    capacity: number;
    conversations: number;
    /** Sequences evicted (least recently used first) to make room since the model was loaded. */
    evictions: number;
  };
  /**
   * Evicted conversations whose pages wait in host memory (hostKvBudgetBytes), and how many were copied out and back
   * since the model was loaded.
   */
  host: { conversations: number; bytes: number; budgetBytes: number; saves: number; restores: number };
  /**
   * The KV store below host memory (null: the engine has none): this model's conversations with a copy there and
   * its bytes, writes and reads since the model was loaded, stored copies found unusable (removed and re-prefilled),
   * and the last problem for a person to read. `storedKv()` counts every record, of every model.
   */
  stored: {
    conversations: number;
    bytes: number;
    saves: number;
    restores: number;
    refused: number;
    note: string | null;
  } | null;
  queue: { running: boolean; waiting: number };
  adapter: AdapterStats | null;
}

/** The KV store's contents (`storedKv()`). */
export interface StoredKvUsage {
  /** Conversations with stored KV, of every model. */
  records: number;
  bytes: number;
  /** Where the store is ("the origin private file system", a directory). */
  where: string;
}

/** The engine as callers see it, in-process (`LongtabEngine`) and through the worker (`createEngine()`). */
export interface LongtabEngineApi {
  load(source: ModelSource, options?: EngineLoadOptions): Promise<ModelInfo>;
  chat: {
    completions: {
      create(request: ChatCompletionRequest & { stream: true }): Promise<CompletionStream<ChatCompletionChunk>>;
      create(request: ChatCompletionRequest & { stream?: false }): Promise<ChatCompletion>;
      create(request: ChatCompletionRequest): Promise<ChatCompletion | CompletionStream<ChatCompletionChunk>>;
    };
  };
  completions: {
    create(request: CompletionRequest & { stream: true }): Promise<CompletionStream<Completion>>;
    create(request: CompletionRequest & { stream?: false }): Promise<Completion>;
    create(request: CompletionRequest): Promise<Completion | CompletionStream<Completion>>;
  };
  stats(): Promise<EngineStats>;
  /**
   * Calls `listener` now and whenever the stats change (load, each request, every few tokens, each step of a
   * background calibration: the event a page shows it with). Returns the unsubscribe.
   */
  subscribeStats(listener: (stats: EngineStats) => void): Promise<() => void>;
  /** Forgets a conversation and frees its KV, its copy in host memory and its record in the KV store. */
  deleteConversation(conversationId: string): Promise<void>;
  /** What the KV store holds, over every model (null: the engine has no store). */
  storedKv(): Promise<StoredKvUsage | null>;
  /** Removes every record of the KV store (conversations then re-prefill their history on their next turn). */
  clearStoredKv(): Promise<void>;
  /** Ends the running request and every queued one; each returns what it generated with finish_reason 'abort'. */
  abort(): Promise<void>;
  unload(): Promise<void>;
}
