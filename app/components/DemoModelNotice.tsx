/**
 * What the demo model is, shown while it is the chosen model: a small model that continues text and does not follow
 * instructions (tools/train-demo-model/README.md), the text mode that suits it, and one step to a chat model.
 */
import type { ModelPreset } from '../models/presets.ts';
import { formatBytes } from '../storage/models.ts';

export interface ChatModelOffer {
  preset: ModelPreset;
  /** 'stored': on this device already (the button selects it); 'downloading': `percent` of it so far. */
  state: 'absent' | 'stored' | 'downloading';
  percent: number | null;
}

export function DemoModelNotice({
  textMode,
  chatModel,
  onTextMode,
  onChatModel,
}: {
  /** The open conversation is in text mode already. */
  textMode: boolean;
  chatModel: ChatModelOffer;
  onTextMode: () => void;
  onChatModel: () => void;
}) {
  const { preset, state, percent } = chatModel;
  return (
    <div className="notice demo-notice" data-testid="demo-about">
      <span>
        The demo model has about 10 million parameters and was trained on public-domain books (the King James Bible and
        Jane Austen's novels). It continues text; it does not follow instructions.
      </span>
      {!textMode && (
        <button type="button" onClick={onTextMode} data-testid="demo-text-mode">
          Continue text
        </button>
      )}
      <button
        type="button"
        className="primary"
        onClick={onChatModel}
        disabled={state === 'downloading'}
        data-testid="demo-chat-model"
      >
        {state === 'downloading'
          ? `Getting ${preset.label}… ${percent === null ? '' : `${percent}%`}`
          : state === 'stored'
            ? `Use a chat model: ${preset.label}`
            : `Get a chat model: ${preset.label}, ≈${formatBytes(preset.approxBytes)}`}
      </button>
    </div>
  );
}
