/** Tokenizer, chat templates and stop strings built from a GGUF file's metadata. */
export {
  type ChatMessage,
  type ChatTemplateContext,
  chatTemplateFromMetadata,
  FALLBACK_CHAT_TEMPLATE,
  renderChatTemplate,
} from './chat-template.ts';
export { StopStringMatcher, type StopStringResult } from './stop-strings.ts';
export { type DecodeOptions, type EncodeOptions, GgufTokenizer, type StreamDecoder } from './tokenizer.ts';
export { TokenType } from './vocab.ts';
