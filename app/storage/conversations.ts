/**
 * Conversations live in IndexedDB (idb-keyval), one record per conversation, written on every change and every
 * few hundred milliseconds while a reply streams: a reload, a crash or a lost GPU device loses at most that much.
 */
import { createStore, del, get, set, values } from 'idb-keyval';

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

export interface Conversation {
  id: string;
  title: string;
  systemPrompt: string;
  messages: StoredMessage[];
  createdAt: number;
  updatedAt: number;
}

const store = createStore('longtab-chat', 'conversations');

export function newId(prefix: string): string {
  return `${prefix}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

export function newConversation(systemPrompt: string): Conversation {
  const now = Date.now();
  return { id: newId('c'), title: 'New chat', systemPrompt, messages: [], createdAt: now, updatedAt: now };
}

/** All conversations, newest first. A reply that was streaming when the page died is marked interrupted. */
export async function loadConversations(): Promise<Conversation[]> {
  const all = await values<Conversation>(store);
  for (const conversation of all) {
    for (const message of conversation.messages) {
      if (message.status === 'streaming') message.status = 'interrupted';
    }
  }
  return all.sort((a, b) => b.updatedAt - a.updatedAt);
}

export async function saveConversation(conversation: Conversation): Promise<void> {
  await set(conversation.id, conversation, store);
}

export async function deleteConversation(id: string): Promise<void> {
  await del(id, store);
}

export async function getConversation(id: string): Promise<Conversation | undefined> {
  return get<Conversation>(id, store);
}

/** A title from the first user message: its first line, shortened. */
export function titleFrom(text: string): string {
  const line = text.trim().split('\n')[0] ?? '';
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || 'New chat';
}
