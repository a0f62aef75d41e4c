import { useEffect } from 'react';

/** Dialogs and the drawer close with Escape (and their own button) while `active` (default: always). */
export function useCloseOnEscape(onClose: () => void, active = true): void {
  useEffect(() => {
    if (!active) return;
    const onKey = (event: KeyboardEvent) => {
      if (event.key === 'Escape') onClose();
    };
    window.addEventListener('keydown', onKey);
    return () => window.removeEventListener('keydown', onKey);
  }, [onClose, active]);
}
