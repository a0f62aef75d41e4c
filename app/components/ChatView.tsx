/** The chat column: messages (markdown for replies, plain text for the user's), and the composer. */
import { useEffect, useRef, useState } from 'react';
import type { Conversation, ConversationMode, StoredMessage } from '../storage/conversations.ts';
import { CopyButton } from './CopyButton.tsx';
import { Markdown } from './Markdown.tsx';
import { copyableText } from './message-text.ts';
import { useCloseOnEscape } from './use-close-on-escape.ts';

/** A user message's text back in an editor: Enter (or Send) replaces the message, Escape (or Cancel) keeps it. */
function MessageEditor({
  initial,
  canSend,
  onSend,
  onCancel,
}: {
  initial: string;
  /** False while a reply streams or the model is not ready. */
  canSend: boolean;
  onSend: (text: string) => void;
  onCancel: () => void;
}) {
  const [text, setText] = useState(initial);
  useCloseOnEscape(onCancel);
  const submit = () => {
    const trimmed = text.trim();
    if (trimmed && canSend) onSend(trimmed);
  };
  return (
    <form
      className="message-editor"
      onSubmit={(e) => {
        e.preventDefault();
        submit();
      }}
    >
      <textarea
        value={text}
        rows={Math.min(8, Math.max(2, text.split('\n').length))}
        aria-label="Edit message"
        data-testid="edit-input"
        // biome-ignore lint/a11y/noAutofocus: the person asked to edit this message; the editor is where they type next
        autoFocus
        onChange={(e) => setText(e.target.value)}
        onKeyDown={(e) => {
          if (e.key === 'Enter' && !e.shiftKey && !e.nativeEvent.isComposing) {
            e.preventDefault();
            submit();
          }
        }}
      />
      <div className="editor-actions">
        <button type="button" className="ghost" onClick={onCancel} data-testid="edit-cancel">
          Cancel
        </button>
        <button type="submit" className="primary" disabled={!canSend || !text.trim()} data-testid="edit-send">
          Send
        </button>
      </div>
    </form>
  );
}

function MessageView({
  message,
  isLast,
  busy,
  canSend,
  editing,
  onRegenerate,
  onEdit,
  onEditCancel,
  onEditSend,
}: {
  message: StoredMessage;
  isLast: boolean;
  busy: boolean;
  canSend: boolean;
  editing: boolean;
  onRegenerate: () => void;
  onEdit: () => void;
  onEditCancel: () => void;
  onEditSend: (text: string) => void;
}) {
  if (message.role === 'user') {
    // The Edit row sits beside the article, not in it: the article holds only what was written.
    return (
      <div className="message user">
        {editing ? (
          <MessageEditor
            initial={message.content}
            canSend={canSend && !busy}
            onSend={onEditSend}
            onCancel={onEditCancel}
          />
        ) : (
          <>
            <article className="user-turn" data-testid="message-user" data-status={message.status} aria-label="You">
              <div className="bubble">
                <div className="user-text">{message.content}</div>
              </div>
            </article>
            <div className="message-meta">
              <button
                type="button"
                className="ghost"
                data-testid="edit-message"
                disabled={busy || !canSend}
                title="Edit this message; sending it replaces the conversation from here on"
                onClick={onEdit}
              >
                Edit
              </button>
            </div>
          </>
        )}
      </div>
    );
  }
  return (
    <article
      className="message assistant"
      data-testid="message-assistant"
      data-status={message.status}
      aria-label="Assistant"
    >
      <div className="bubble">
        {message.content ? (
          <Markdown text={message.content} />
        ) : message.status === 'streaming' ? (
          <span className="typing" role="status" aria-label="thinking">
            <i />
            <i />
            <i />
          </span>
        ) : (
          <span className="muted">(no text)</span>
        )}
      </div>
      {message.status !== 'streaming' && (
        <div className="message-meta">
          {message.status === 'stopped' && <span className="tag">stopped</span>}
          {message.status === 'interrupted' && <span className="tag">interrupted</span>}
          {message.status === 'error' && <span className="tag error">error</span>}
          {message.note && (
            <span className={message.status === 'error' ? 'note error' : 'note muted'}>{message.note}</span>
          )}
          {message.stats && (
            <span className="muted small">
              {message.stats.completionTokens} tokens · {message.stats.decodeTokensPerSecond.toFixed(1)} tok/s
            </span>
          )}
          <CopyButton className="ghost" testId="copy-message" text={() => copyableText(message.content)} />
          {isLast && (
            <button type="button" className="ghost" data-testid="regenerate" disabled={busy} onClick={onRegenerate}>
              Regenerate
            </button>
          )}
        </div>
      )}
    </article>
  );
}

export function ChatView({
  conversation,
  busy,
  canSend,
  modelHint,
  waitingFor,
  onSend,
  onStop,
  onRegenerate,
  onEditResend,
  onSystemPrompt,
  onMode,
}: {
  conversation: Conversation | null;
  busy: boolean;
  canSend: boolean;
  modelHint: string | null;
  /** What the composer waits for while it cannot send (a model to choose, or the chosen one loading). */
  waitingFor: string;
  onSend: (text: string) => void;
  onStop: () => void;
  onRegenerate: () => void;
  /** Replaces a user message with `text`, drops the messages after it and asks for a new reply. */
  onEditResend: (messageId: string, text: string) => void;
  onSystemPrompt: (text: string) => void;
  onMode: (mode: ConversationMode) => void;
}) {
  const [draft, setDraft] = useState('');
  // An editor belongs to the conversation it was opened in: another one shows none.
  const [editing, setEditing] = useState<{ conversationId: string; messageId: string } | null>(null);
  const editingId = editing && editing.conversationId === conversation?.id ? editing.messageId : null;
  const [showSystem, setShowSystem] = useState(false);
  const scroller = useRef<HTMLDivElement>(null);
  const messages = conversation?.messages ?? [];
  const lastContent = messages[messages.length - 1]?.content.length ?? 0;
  const textMode = conversation?.mode === 'text';

  // Follow the stream, unless the reader scrolled up.
  useEffect(() => {
    const el = scroller.current;
    if (el && lastContent >= 0 && el.scrollHeight - el.scrollTop - el.clientHeight < 160)
      el.scrollTop = el.scrollHeight;
  }, [lastContent]);

  const submit = () => {
    const text = draft.trim();
    if (!text || busy || !canSend) return;
    onSend(text);
    setDraft('');
  };

  return (
    <section className="chat" aria-label="Chat">
      <div className="system-row">
        <div className="mode-row">
          <div className="segmented small" role="radiogroup" aria-label="Conversation mode">
            {(['chat', 'text'] as const).map((mode) => (
              <label key={mode} className={(textMode ? 'text' : 'chat') === mode ? 'on' : ''}>
                <input
                  type="radio"
                  name="conversation-mode"
                  value={mode}
                  checked={(textMode ? 'text' : 'chat') === mode}
                  disabled={busy || !conversation}
                  data-testid={`mode-${mode}`}
                  onChange={() => onMode(mode)}
                />
                {mode === 'chat' ? 'Chat' : 'Continue text'}
              </label>
            ))}
          </div>
          {!textMode && (
            <button
              type="button"
              className="ghost small"
              onClick={() => setShowSystem((v) => !v)}
              data-testid="toggle-system"
            >
              {showSystem ? '▾' : '▸'} System prompt
              {!showSystem && conversation?.systemPrompt ? `: ${conversation.systemPrompt.slice(0, 60)}` : ''}
            </button>
          )}
        </div>
        {showSystem && !textMode && (
          <textarea
            className="system-prompt"
            rows={2}
            value={conversation?.systemPrompt ?? ''}
            placeholder="Instructions the model sees before the conversation"
            data-testid="system-prompt"
            disabled={busy}
            onChange={(e) => onSystemPrompt(e.target.value)}
          />
        )}
      </div>
      <div className="messages" ref={scroller} data-testid="messages">
        {messages.length === 0 && (
          <div className="empty">
            <h2>
              {textMode ? 'Write the start of a passage; the model continues it' : 'Chat with a model on your own GPU'}
            </h2>
            <p className="muted">{modelHint ?? 'Nothing leaves this tab.'}</p>
          </div>
        )}
        {messages.map((message, index) => (
          <MessageView
            key={message.id}
            message={message}
            isLast={index === messages.length - 1}
            busy={busy}
            canSend={canSend}
            editing={message.id === editingId}
            onRegenerate={onRegenerate}
            onEdit={() => conversation && setEditing({ conversationId: conversation.id, messageId: message.id })}
            onEditCancel={() => setEditing(null)}
            onEditSend={(text) => {
              setEditing(null);
              onEditResend(message.id, text);
            }}
          />
        ))}
      </div>
      <form
        className="composer"
        onSubmit={(e) => {
          e.preventDefault();
          submit();
        }}
      >
        <textarea
          value={draft}
          rows={2}
          placeholder={
            !canSend
              ? waitingFor
              : textMode
                ? 'The start of a passage for the model to continue (Enter to send)'
                : 'Message (Enter to send, Shift+Enter for a new line)'
          }
          aria-label="Message"
          data-testid="composer-input"
          onChange={(e) => setDraft(e.target.value)}
          onKeyDown={(e) => {
            if (e.key === 'Enter' && !e.shiftKey && !e.nativeEvent.isComposing) {
              e.preventDefault();
              submit();
            }
          }}
        />
        {busy ? (
          <button type="button" className="danger" onClick={onStop} data-testid="stop">
            Stop
          </button>
        ) : (
          <button type="submit" className="primary" disabled={!canSend || !draft.trim()} data-testid="send">
            Send
          </button>
        )}
      </form>
    </section>
  );
}
