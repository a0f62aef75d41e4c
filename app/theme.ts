/**
 * The page's theme: the choice goes on the root element as `data-theme` (styles.css picks the palette from it, and
 * from the browser's preference for 'system'), so no listener has to follow the system's changes.
 */
import type { ThemeChoice } from './storage/settings.ts';

export function applyTheme(theme: ThemeChoice): void {
  document.documentElement.dataset.theme = theme;
}
