/**
 * Conversations live in IndexedDB (idb-keyval), one record per conversation, written on every change and every
 * few hundred milliseconds while a reply streams: a reload, a crash or a lost GPU device loses at most that much.
 */
import { clear, createStore, del, get, set, type UseStore, values } from 'idb-keyval';

export type MessageStatus = 'done' | 'streaming' | 'stopped' | 'error' | 'interrupted';

export interface StoredMessage {
  id: string;
  role: 'user' | 'assistant';
  content: string;
  createdAt: number;
  status: MessageStatus;
  /** Why generation ended early (error text), shown under the message. */
  note?: string;
  /** Timing for an assistant reply, from the engine's usage. */
  stats?: { completionTokens: number; decodeTokensPerSecond: number; ttftMs: number };
}

/**
 * 'chat': messages through the model's chat template. 'text': the messages are one passage that the model continues
 * (the completions API), for models that continue text rather than follow instructions, such as the demo model.
 */
export type ConversationMode = 'chat' | 'text';

export interface Conversation {
  id: string;
  title: string;
  /** Absent in conversations stored before text mode existed: chat. */
  mode?: ConversationMode;
  systemPrompt: string;
  messages: StoredMessage[];
  createdAt: number;
  updatedAt: number;
}

let store: UseStore | null = null;
/** Opened on first use, so importing this module (its pure functions, in unit tests) needs no IndexedDB. */
function conversationStore(): UseStore {
  store ??= createStore('longtab-chat', 'conversations');
  return store;
}

export function newId(prefix: string): string {
  return `${prefix}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

export function newConversation(systemPrompt: string, mode: ConversationMode = 'chat'): Conversation {
  const now = Date.now();
  return { id: newId('c'), title: 'New chat', mode, systemPrompt, messages: [], createdAt: now, updatedAt: now };
}

/**
 * A text-mode conversation as the passage the model continues: its messages in order (failed or empty replies left
 * out). A reply is the model's own continuation, kept as it came; a part the person wrote after it gets a space
 * where the two would otherwise run together.
 */
export function passageText(messages: readonly StoredMessage[]): string {
  let text = '';
  for (const m of messages) {
    if (m.role === 'assistant' && (m.status === 'error' || !m.content)) continue;
    const joins = m.role === 'assistant' || text === '' || /\s$/.test(text) || /^\s/.test(m.content);
    text += joins ? m.content : ` ${m.content}`;
  }
  return text;
}

/** All conversations, newest first. A reply that was streaming when the page died is marked interrupted. */
export async function loadConversations(): Promise<Conversation[]> {
  const all = await values<Conversation>(conversationStore());
  for (const conversation of all) {
    for (const message of conversation.messages) {
      if (message.status === 'streaming') message.status = 'interrupted';
    }
  }
  return all.sort((a, b) => b.updatedAt - a.updatedAt);
}

export async function saveConversation(conversation: Conversation): Promise<void> {
  await set(conversation.id, conversation, conversationStore());
}

export async function deleteConversation(id: string): Promise<void> {
  await del(id, conversationStore());
}

/** Removes every stored conversation. */
export async function deleteAllConversations(): Promise<void> {
  await clear(conversationStore());
}

export async function getConversation(id: string): Promise<Conversation | undefined> {
  return get<Conversation>(id, conversationStore());
}

/** A title from the first user message: its first line, shortened. */
export function titleFrom(text: string): string {
  const line = text.trim().split('\n')[0] ?? '';
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || 'New chat';
}

/**
 * The conversation with one of its user messages rewritten and every message after it dropped, ready for a new reply;
 * null when `messageId` is not a user message of it. A title that was made from the first message follows the edit.
 * The engine's cache for the conversation compares token prefixes, so the next request re-prefills from the first
 * token that differs: nothing of the dropped turns is reused.
 */
export function withEditedMessage(conversation: Conversation, messageId: string, text: string): Conversation | null {
  const index = conversation.messages.findIndex((m) => m.id === messageId);
  const message = conversation.messages[index];
  if (message?.role !== 'user') return null;
  const firstUser = conversation.messages.find((m) => m.role === 'user');
  const titleFollows = firstUser === message && conversation.title === titleFrom(message.content);
  return {
    ...conversation,
    title: titleFollows ? titleFrom(text) : conversation.title,
    messages: [...conversation.messages.slice(0, index), { ...message, content: text }],
    updatedAt: Date.now(),
  };
}
