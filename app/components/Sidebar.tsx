/** The conversation list: new, select, rename (inline), delete. */
import { useState } from 'react';
import type { Conversation } from '../storage/conversations.ts';
import { useCloseOnEscape } from './use-close-on-escape.ts';

export function Sidebar({
  conversations,
  activeId,
  onNew,
  onSelect,
  onRename,
  onDelete,
  open,
  onClose,
}: {
  conversations: Conversation[];
  activeId: string | null;
  onNew: () => void;
  onSelect: (id: string) => void;
  onRename: (id: string, title: string) => void;
  onDelete: (id: string) => void;
  open: boolean;
  /** Closes the drawer (narrow windows): its ☰ button, Escape, or a tap outside it. */
  onClose: () => void;
}) {
  const [editing, setEditing] = useState<string | null>(null);
  const [draft, setDraft] = useState('');
  useCloseOnEscape(onClose, open);
  return (
    <>
      {open && <div className="drawer-backdrop" data-testid="drawer-backdrop" onClick={onClose} aria-hidden="true" />}
      <nav className={`sidebar ${open ? 'open' : ''}`} aria-label="Conversations">
        <div className="brand">
          <button
            type="button"
            className="icon only-narrow"
            aria-label="Close conversations"
            data-testid="close-drawer"
            onClick={onClose}
          >
            ☰
          </button>
          <img src="/favicon.svg" alt="" width={22} height={22} />
          <span>longtab</span>
        </div>
        <button type="button" className="primary new-chat" onClick={onNew} data-testid="new-chat">
          + New chat
        </button>
        <ul className="conversation-list" data-testid="conversation-list">
          {conversations.map((conversation) => (
            <li
              key={conversation.id}
              className={conversation.id === activeId ? 'active' : ''}
              data-testid="conversation-item"
              data-conversation-id={conversation.id}
            >
              {editing === conversation.id ? (
                <form
                  onSubmit={(e) => {
                    e.preventDefault();
                    onRename(conversation.id, draft.trim() || conversation.title);
                    setEditing(null);
                  }}
                >
                  <input
                    // biome-ignore lint/a11y/noAutofocus: the rename field appears because the user asked for it
                    autoFocus
                    value={draft}
                    aria-label="Conversation title"
                    data-testid="rename-input"
                    onChange={(e) => setDraft(e.target.value)}
                    onBlur={() => setEditing(null)}
                    onKeyDown={(e) => e.key === 'Escape' && setEditing(null)}
                  />
                </form>
              ) : (
                <>
                  <button type="button" className="conversation-title" onClick={() => onSelect(conversation.id)}>
                    {conversation.title}
                  </button>
                  <span className="conversation-actions">
                    <button
                      type="button"
                      className="icon"
                      title="Rename"
                      aria-label={`Rename ${conversation.title}`}
                      onClick={() => {
                        setDraft(conversation.title);
                        setEditing(conversation.id);
                      }}
                    >
                      <svg viewBox="0 0 16 16" width="14" height="14" aria-hidden="true">
                        <path d="M11 2l3 3-8 8H3v-3z" fill="none" stroke="currentColor" strokeWidth="1.5" />
                      </svg>
                    </button>
                    <button
                      type="button"
                      className="icon"
                      title="Delete"
                      aria-label={`Delete ${conversation.title}`}
                      onClick={() => {
                        if (window.confirm(`Delete “${conversation.title}”?`)) onDelete(conversation.id);
                      }}
                    >
                      <svg viewBox="0 0 16 16" width="14" height="14" aria-hidden="true">
                        <path
                          d="M3 4h10M6 4V2.5h4V4M4.5 4l.7 9.5h5.6l.7-9.5"
                          fill="none"
                          stroke="currentColor"
                          strokeWidth="1.5"
                        />
                      </svg>
                    </button>
                  </span>
                </>
              )}
            </li>
          ))}
        </ul>
      </nav>
    </>
  );
}
