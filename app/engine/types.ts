/**
 * The slice of the engine's OpenAI-shaped API that the chat page uses. The data types are the library's own
 * (workers/index.ts); only the request and engine shapes the page relies on are narrowed here, so the worker client
 * satisfies `ChatEngine` structurally (see engine-client.ts).
 */
import type {
  ChatCompletionChunk,
  ChatCompletionRequest,
  Completion,
  CompletionRequest,
  CompletionStream,
  EngineLoadOptions,
  EngineStats,
  ModelInfo,
  StoredKvUsage,
} from '../../workers/index.ts';

export type {
  ChatCompletionChunk,
  ChatMessageParam,
  CompletionStream,
  CompletionUsage,
  EngineStats,
  FinishReason,
  GenerationStats,
  KvMode,
  LoadProgress,
  ModelInfo,
  StoredKvUsage,
} from '../../workers/index.ts';

export type ChatRequest = ChatCompletionRequest & { stream: true };
/** Raw text continued by the model (the page's text mode). */
export type TextRequest = CompletionRequest & { stream: true };

/** The load options the page sets (its KV settings; persist where the engine has a KV store); the rest keep defaults. */
export type ChatLoadOptions = Pick<EngineLoadOptions, 'kv' | 'kvBudgetBytes' | 'persist' | 'onProgress'>;

/** What the chat page needs from an engine. */
export interface ChatEngine {
  load(source: string | Blob, options: ChatLoadOptions): Promise<ModelInfo>;
  chat: { completions: { create(request: ChatRequest): Promise<CompletionStream<ChatCompletionChunk>> } };
  completions: { create(request: TextRequest): Promise<CompletionStream<Completion>> };
  stats(): Promise<EngineStats>;
  subscribeStats(listener: (stats: EngineStats) => void): Promise<() => void>;
  deleteConversation(conversationId: string): Promise<void>;
  storedKv(): Promise<StoredKvUsage | null>;
  clearStoredKv(): Promise<void>;
  abort(): Promise<void>;
  unload(): Promise<void>;
}
