/** The chat column: messages (markdown for replies, plain text for the user's), and the composer. */
import { useEffect, useRef, useState } from 'react';
import type { Conversation, StoredMessage } from '../storage/conversations.ts';
import { CopyButton } from './CopyButton.tsx';
import { Markdown } from './Markdown.tsx';
import { copyableText } from './message-text.ts';

function MessageView({
  message,
  isLast,
  busy,
  onRegenerate,
}: {
  message: StoredMessage;
  isLast: boolean;
  busy: boolean;
  onRegenerate: () => void;
}) {
  return (
    <article
      className={`message ${message.role}`}
      data-testid={`message-${message.role}`}
      data-status={message.status}
      aria-label={message.role === 'user' ? 'You' : 'Assistant'}
    >
      <div className="bubble">
        {message.role === 'assistant' ? (
          message.content ? (
            <Markdown text={message.content} />
          ) : message.status === 'streaming' ? (
            <span className="typing" role="status" aria-label="thinking">
              <i />
              <i />
              <i />
            </span>
          ) : (
            <span className="muted">(no text)</span>
          )
        ) : (
          <div className="user-text">{message.content}</div>
        )}
      </div>
      {message.role === 'assistant' && message.status !== 'streaming' && (
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
  onSystemPrompt,
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
  onSystemPrompt: (text: string) => void;
}) {
  const [draft, setDraft] = useState('');
  const [showSystem, setShowSystem] = useState(false);
  const scroller = useRef<HTMLDivElement>(null);
  const messages = conversation?.messages ?? [];
  const lastContent = messages[messages.length - 1]?.content.length ?? 0;

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
        <button
          type="button"
          className="ghost small"
          onClick={() => setShowSystem((v) => !v)}
          data-testid="toggle-system"
        >
          {showSystem ? '▾' : '▸'} System prompt
          {!showSystem && conversation?.systemPrompt ? `: ${conversation.systemPrompt.slice(0, 60)}` : ''}
        </button>
        {showSystem && (
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
            <h2>Chat with a model on your own GPU</h2>
            <p className="muted">{modelHint ?? 'Nothing leaves this tab.'}</p>
          </div>
        )}
        {messages.map((message, index) => (
          <MessageView
            key={message.id}
            message={message}
            isLast={index === messages.length - 1}
            busy={busy}
            onRegenerate={onRegenerate}
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
          placeholder={canSend ? 'Message (Enter to send, Shift+Enter for a new line)' : waitingFor}
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
