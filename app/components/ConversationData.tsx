/**
 * The conversations as data, in Settings: export all of them (JSON) or the open one (Markdown), import an exported
 * file beside the ones stored, delete all of them (App asks for confirmation in its own dialog).
 */
import { useState } from 'react';
import { errorMessage } from '../engine/engine-client.ts';

export interface ConversationDataActions {
  count: number;
  /** The open conversation's title, or null when there is none to export. */
  activeTitle: string | null;
  /** A reply is being written: importing or deleting waits for it. */
  busy: boolean;
  exportAll(): void;
  exportActive(): void;
  /** Resolves with what was imported; rejects with a message that says what is wrong with the file. */
  importFile(file: File): Promise<string>;
  askDeleteAll(): void;
}

export function ConversationData({ actions }: { actions: ConversationDataActions }) {
  const [outcome, setOutcome] = useState<{ ok: boolean; text: string } | null>(null);
  return (
    <section data-testid="conversation-data">
      <h3>Conversations</h3>
      <div className="data-actions">
        <button type="button" onClick={actions.exportAll} disabled={actions.count === 0} data-testid="export-json">
          Export all ({actions.count}) as JSON
        </button>
        <button
          type="button"
          onClick={actions.exportActive}
          disabled={actions.activeTitle === null}
          data-testid="export-markdown"
        >
          Export this chat as Markdown
        </button>
        <label className="file-button">
          <input
            type="file"
            accept=".json,application/json"
            disabled={actions.busy}
            data-testid="import-conversations"
            onChange={async (event) => {
              const file = event.target.files?.[0];
              event.target.value = '';
              if (!file) return;
              try {
                setOutcome({ ok: true, text: await actions.importFile(file) });
              } catch (error) {
                setOutcome({ ok: false, text: errorMessage(error) });
              }
            }}
          />
          <span className="button-like">Import JSON…</span>
        </label>
        <button
          type="button"
          className="danger"
          onClick={actions.askDeleteAll}
          disabled={actions.busy}
          data-testid="delete-all"
        >
          Delete all…
        </button>
      </div>
      {outcome &&
        (outcome.ok ? (
          <p className="hint" role="status" data-testid="import-result">
            {outcome.text}
          </p>
        ) : (
          <div className="alert" role="alert" data-testid="import-error">
            {outcome.text}
          </div>
        ))}
      <p className="hint">An import adds the file's conversations beside these and replaces none.</p>
    </section>
  );
}
