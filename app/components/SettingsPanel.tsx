/**
 * Generation, engine and appearance settings. KV mode and budget take effect when the model (re)loads. A typed value
 * that breaks its rule (settings.ts) is kept in its field with the rule beside it, and not saved until it is fixed.
 */
import { useId, useState } from 'react';
import type { StoredModel } from '../storage/models.ts';
import {
  type Checked,
  checkNumberSetting,
  checkSeed,
  formatStopSequences,
  NUMBER_SETTINGS,
  type NumberSettingKey,
  parseStopSequences,
  type Settings,
  THEME_CHOICES,
} from '../storage/settings.ts';
import { ConversationData, type ConversationDataActions } from './ConversationData.tsx';
import { Modal } from './Modal.tsx';

const THEME_LABELS = { system: 'System', light: 'Light', dark: 'Dark' } as const;

/** A field that saves what is typed once it checks out, and otherwise says what is wrong with it. */
function CheckedField<T>({
  label,
  initial,
  check,
  onValid,
  testId,
  multiline = false,
  inputMode,
  hint,
}: {
  label: string;
  initial: string;
  check: (text: string) => Checked<T>;
  onValid: (value: T) => void;
  testId: string;
  multiline?: boolean;
  inputMode?: 'decimal' | 'numeric';
  hint?: string;
}) {
  const [text, setText] = useState(initial);
  const [error, setError] = useState<string | null>(null);
  const id = useId();
  const errorId = `${id}-error`;
  const onText = (next: string) => {
    setText(next);
    const checked = check(next);
    setError(checked.ok ? null : checked.error);
    if (checked.ok) onValid(checked.value);
  };
  const shared = {
    id,
    value: text,
    'data-testid': testId,
    'aria-invalid': error !== null,
    'aria-describedby': error !== null ? errorId : undefined,
  };
  return (
    <div className="field">
      <label htmlFor={id}>{label}</label>
      {multiline ? (
        <textarea rows={2} {...shared} onChange={(e) => onText(e.target.value)} />
      ) : (
        <input type="text" inputMode={inputMode} {...shared} onChange={(e) => onText(e.target.value)} />
      )}
      {error !== null ? (
        <span className="field-error" role="alert" id={errorId} data-testid={`${testId}-error`}>
          {error}
        </span>
      ) : (
        hint && <span className="hint">{hint}</span>
      )}
    </div>
  );
}

export function SettingsPanel({
  settings,
  models,
  data,
  kvHolds,
  onChange,
  onClose,
}: {
  settings: Settings;
  models: StoredModel[];
  /** What the loaded model's KV budget holds (kvHoldsText), or null with no model loaded. */
  kvHolds: string | null;
  /** Export, import and delete-all of the conversations. */
  data: ConversationDataActions;
  onChange: (patch: Partial<Settings>) => void;
  onClose: () => void;
}) {
  const numberField = (key: NumberSettingKey, label: string) => {
    const rule = NUMBER_SETTINGS[key];
    return (
      <CheckedField
        label={label}
        initial={String(settings[key])}
        check={(text) => checkNumberSetting(key, text)}
        onValid={(value) => onChange({ [key]: value })}
        testId={`setting-${key}`}
        inputMode={rule.integer ? 'numeric' : 'decimal'}
      />
    );
  };
  return (
    <Modal titleId="settings-title" testId="settings-panel" narrow onClose={onClose}>
      <header className="modal-header">
        <h2 id="settings-title">Settings</h2>
        <button type="button" className="icon" onClick={onClose} aria-label="Close">
          ✕
        </button>
      </header>
      <section>
        <h3>Model</h3>
        <label className="field">
          <span>Stored model (manage them from the model button)</span>
          <select
            value={settings.modelId ?? ''}
            data-testid="setting-model"
            onChange={(e) => onChange({ modelId: e.target.value || null })}
          >
            <option value="">None</option>
            {models
              .filter((m) => m.complete)
              .map((m) => (
                <option key={m.id} value={m.id}>
                  {m.name}
                </option>
              ))}
          </select>
        </label>
      </section>
      <section>
        <h3>KV cache</h3>
        <div className="segmented" role="radiogroup" aria-label="KV mode">
          {(['int2', 'f16'] as const).map((mode) => (
            <label key={mode} className={settings.kv === mode ? 'on' : ''}>
              <input
                type="radio"
                name="kv"
                value={mode}
                checked={settings.kv === mode}
                data-testid={`kv-${mode}`}
                onChange={() => onChange({ kv: mode })}
              />
              {mode === 'int2' ? 'int2 (~2-bit, ~7× the tokens per MiB)' : 'f16 (exact)'}
            </label>
          ))}
        </div>
        {numberField('kvBudgetMiB', 'KV budget (MiB of GPU memory)')}
        {kvHolds && (
          <p className="hint" data-testid="settings-kv-holds">
            With the loaded model: {kvHolds}.
          </p>
        )}
        <p className="hint">
          int2 is the default; a model whose K/V rows do not split into 2-bit groups loads f16 instead (the model chip
          and the stats show the mode in use). Changing these reloads the model before the next message.
        </p>
      </section>
      <section>
        <h3>Sampling</h3>
        {numberField('temperature', 'Temperature (0 = greedy)')}
        {numberField('topP', 'Top-p (1 = off)')}
        {numberField('topK', 'Top-k (0 = off)')}
        {numberField('minP', 'Min-p (0 = off)')}
        {numberField('repetitionPenalty', 'Repetition penalty (1 = off)')}
        {numberField('maxTokens', 'Max new tokens')}
        <CheckedField
          label="Seed (empty = a new random one for each reply)"
          initial={settings.seed === null ? '' : String(settings.seed)}
          check={checkSeed}
          onValid={(seed) => onChange({ seed })}
          testId="setting-seed"
          inputMode="numeric"
          hint="With a seed, the same conversation gets the same reply again."
        />
        <CheckedField
          label="Stop sequences (one a line; \n is a line break)"
          initial={formatStopSequences(settings.stop)}
          check={parseStopSequences}
          onValid={(stop) => onChange({ stop })}
          testId="setting-stop"
          multiline
          hint="The reply ends before the first one it would write."
        />
      </section>
      <section>
        <h3>Appearance</h3>
        <div className="segmented" role="radiogroup" aria-label="Theme">
          {THEME_CHOICES.map((theme) => (
            <label key={theme} className={settings.theme === theme ? 'on' : ''}>
              <input
                type="radio"
                name="theme"
                value={theme}
                checked={settings.theme === theme}
                data-testid={`theme-${theme}`}
                onChange={() => onChange({ theme })}
              />
              {THEME_LABELS[theme]}
            </label>
          ))}
        </div>
      </section>
      <section>
        <h3>New chats</h3>
        <label className="field">
          <span>Default system prompt</span>
          <textarea
            rows={3}
            value={settings.defaultSystemPrompt}
            onChange={(e) => onChange({ defaultSystemPrompt: e.target.value })}
          />
        </label>
      </section>
      <ConversationData actions={data} />
      <section>
        <h3>Downloads</h3>
        <label className="field">
          <span>Model hub base URL</span>
          <input
            type="url"
            value={settings.hubBaseUrl}
            data-testid="setting-hub"
            onChange={(e) => onChange({ hubBaseUrl: e.target.value })}
          />
        </label>
        <p className="hint">Presets download from &lt;base&gt;/&lt;repo&gt;/resolve/main/&lt;file&gt;.</p>
      </section>
    </Modal>
  );
}
