import { type KeyboardEvent, type ReactNode, useEffect, useRef } from 'react';

const FOCUSABLE = 'a[href], button, input, select, textarea, [tabindex]:not([tabindex="-1"])';

/** The controls Tab reaches inside `root`, in order. */
function tabStops(root: HTMLElement): HTMLElement[] {
  return [...root.querySelectorAll<HTMLElement>(FOCUSABLE)].filter(
    (e) => !e.matches(':disabled') && e.tabIndex >= 0 && e.getClientRects().length > 0,
  );
}

/** Tab past the last control goes to the first, Shift+Tab before the first to the last: focus stays in the dialog. */
function keepTabInside(event: KeyboardEvent<HTMLDialogElement>): void {
  if (event.key !== 'Tab') return;
  const stops = tabStops(event.currentTarget);
  if (stops.length === 0) return;
  const first = stops[0];
  const last = stops[stops.length - 1];
  const active = document.activeElement;
  if (event.shiftKey && (active === first || active === event.currentTarget)) {
    event.preventDefault();
    last.focus();
  } else if (!event.shiftKey && active === last) {
    event.preventDefault();
    first.focus();
  }
}

/**
 * A modal dialog on the platform's `<dialog>`: `showModal()` makes the rest of the page inert, so Tab cycles inside
 * it and the page behind takes no clicks; Tab and Shift+Tab wrap around its controls rather than leave for the
 * browser's own; focus moves into it when it opens and goes back to the control that had it (the button that opened
 * it) when it closes, and back into it when the control that had it goes away; Escape closes it through `onClose`,
 * as its ✕ does.
 */
export function Modal({
  titleId,
  testId,
  narrow = false,
  onClose,
  children,
}: {
  /** The id of the heading that names the dialog. */
  titleId: string;
  testId: string;
  narrow?: boolean;
  onClose: () => void;
  children: ReactNode;
}) {
  const ref = useRef<HTMLDialogElement>(null);
  useEffect(() => {
    const dialog = ref.current;
    if (!dialog) return;
    const opener = document.activeElement instanceof HTMLElement ? document.activeElement : null;
    dialog.showModal();
    // A control that goes away while it has focus (a finished download's Pause) leaves focus on the page's body,
    // outside the dialog: focus goes back to the dialog's first control.
    const refocus = new MutationObserver(() => {
      if (dialog.open && !dialog.contains(document.activeElement)) (tabStops(dialog)[0] ?? dialog).focus();
    });
    refocus.observe(dialog, { childList: true, subtree: true });
    return () => {
      refocus.disconnect();
      if (dialog.open) dialog.close();
      if (opener?.isConnected) opener.focus();
    };
  }, []);
  return (
    <dialog
      ref={ref}
      className={narrow ? 'modal narrow' : 'modal'}
      aria-labelledby={titleId}
      data-testid={testId}
      onKeyDown={keepTabInside}
      onCancel={(event) => {
        // Escape: the parent decides (it unmounts the dialog, which closes it and returns focus).
        event.preventDefault();
        onClose();
      }}
    >
      {children}
    </dialog>
  );
}
