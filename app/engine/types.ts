/**
 * The slice of the engine's OpenAI-shaped API that the chat page uses, declared here so the UI depends on this file
 * only (the worker client satisfies it structurally; see engine-client.ts).
 */
export type KvMode = 'f16' | 'int2';

export interface LoadProgress {
  phase: 'download' | 'parse' | 'upload' | 'calibrate';
  bytesDone: number;
  bytesTotal: number;
}

export interface ModelInfo {
  name: string;
  architecture: string;
  layers: number;
  vocab: number;
  contextLength: number;
  contextCapacity: number;
  kv: KvMode;
  hasChatTemplate: boolean;
}

export interface ChatMessageParam {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

export type FinishReason = 'stop' | 'length' | 'abort';

export interface GenerationStats {
  prefill_tokens: number;
  prefill_tokens_per_second: number;
  decode_tokens_per_second: number;
  ttft_ms: number;
  tpot_ms: number;
  dropped_messages: number;
}

export interface CompletionUsage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details?: { cached_tokens: number };
  longtab?: GenerationStats;
}

export interface ChatCompletionChunk {
  id: string;
  choices: Array<{ delta: { role?: 'assistant'; content?: string }; finish_reason: FinishReason | null }>;
  usage?: CompletionUsage;
}

export interface ChatRequest {
  messages: ChatMessageParam[];
  stream: true;
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  conversation_id?: string;
  context_overflow?: 'error' | 'drop_oldest_turns';
}

export interface CompletionStream<T> extends AsyncIterable<T> {
  abort(): void;
}

export interface EngineStats {
  model: ModelInfo | null;
  memory: {
    weights: number;
    kvUsed: number;
    kvReserved: number;
    kvF16Equivalent: number;
    scratch: number;
    staging: number;
    total: number;
    peak: number;
  };
  kv: {
    mode: KvMode;
    pageTokens: number;
    pageBytes: number;
    pagesUsed: number;
    pagesFree: number;
    pagesReserved: number;
    pagesBudget: number;
    sequences: number;
  };
  context: { used: number; capacity: number; conversations: number };
  adapter?: { isFallbackAdapter?: boolean; description?: string; vendor?: string } | null;
}

export interface LoadOptions {
  kv: KvMode;
  kvBudgetBytes: number;
  onProgress?: (progress: LoadProgress) => void;
}

/** What the chat page needs from an engine. */
export interface ChatEngine {
  load(source: string | Blob, options: LoadOptions): Promise<ModelInfo>;
  chat: { completions: { create(request: ChatRequest): Promise<CompletionStream<ChatCompletionChunk>> } };
  stats(): Promise<EngineStats>;
  subscribeStats(listener: (stats: EngineStats) => void): Promise<() => void>;
  deleteConversation(conversationId: string): Promise<void>;
  abort(): Promise<void>;
  unload(): Promise<void>;
}
