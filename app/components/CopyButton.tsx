import { useState } from 'react';

/** Writes text to the clipboard; where permission is denied (or the context is insecure), through a hidden textarea. */
async function copyText(text: string): Promise<void> {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement('textarea');
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand('copy');
    area.remove();
  }
}

/** A Copy button that copies `text()` and says "Copied" for a moment. */
export function CopyButton({ text, className, testId }: { text: () => string; className: string; testId: string }) {
  const [copied, setCopied] = useState(false);
  return (
    <button
      type="button"
      className={className}
      data-testid={testId}
      onClick={async () => {
        await copyText(text());
        setCopied(true);
        setTimeout(() => setCopied(false), 1500);
      }}
    >
      {copied ? 'Copied' : 'Copy'}
    </button>
  );
}
