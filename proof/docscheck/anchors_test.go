package docscheck

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unicode"
)

// The longest a page may get: a newcomer reads the README in one sitting,
// and a docs page that grows past this is split by topic (docs/README.md is
// the index), not scrolled.
const (
	maxReadmeLines  = 199
	maxDocsPageLine = 500
)

// anchorsOf returns the GitHub anchors of a Markdown file's headings: lower
// case, punctuation other than '-' and '_' dropped, each space a '-', and a
// repeated heading suffixed -1, -2, ... in order. Lines in code fences are
// not headings.
func anchorsOf(text string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		level := len(line) - len(strings.TrimLeft(line, "#"))
		if level == 0 || level > 6 || len(line) == level || line[level] != ' ' {
			continue
		}
		a := slug(strings.TrimSpace(line[level:]))
		if n := seen[a]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

// slug is GitHub's anchor of one heading's text.
func slug(title string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(title) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestSlug pins the anchor rule on headings of this repository's docs.
func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"Choosing --on-publish":                               "choosing---on-publish",
		"Restarts and the slot's restart position":            "restarts-and-the-slots-restart-position",
		"Kubernetes (Helm)":                                   "kubernetes-helm",
		"One large transaction (issue 21, G15): case `bigtx`": "one-large-transaction-issue-21-g15-case-bigtx",
		"prune: retention for `--on-publish mark` and `none`": "prune-retention-for---on-publish-mark-and-none",
	} {
		if got := slug(in); got != want {
			t.Errorf("slug(%q) = %q, want %q", in, got, want)
		}
	}
	a := anchorsOf("# T\n\n### Recorded run\n\n```sh\n# not a heading\n```\n\n### Recorded run\n")
	for _, want := range []string{"t", "recorded-run", "recorded-run-1"} {
		if !a[want] {
			t.Errorf("anchorsOf: %q missing from %v", want, a)
		}
	}
	if a["not-a-heading"] {
		t.Errorf("anchorsOf took a line in a code fence for a heading: %v", a)
	}
}

var (
	// A Markdown link with an anchor: [text](page.md#anchor) or (#anchor).
	anchorLink = regexp.MustCompile(`\]\(([^)#\s]*)#([^)\s]+)\)`)
	// An anchor into docs/ named outside a link, in any file of the
	// repository: runbook_url annotations, comments, help texts.
	docsAnchor = regexp.MustCompile(`(?:^|[^\w.-])((?:\.\./)*docs/([a-z0-9_-]+\.md))#([A-Za-z0-9_-]+)`)
	// A section cited by its heading: docs/deploy.md, "The broker contract"
	// (in Go strings the quotes are escaped).
	docsSection = regexp.MustCompile(`docs/([a-z0-9_-]+\.md),\s+\\?"([^"\\]+)\\?"`)
)

// TestDocLinksReachAHeading fails for every link into a Markdown page's
// section (README.md and docs/*.md: page.md#anchor, #anchor) whose page has
// no heading with that anchor, and for every docs/<page>.md#anchor or
// docs/<page>.md, "Heading" cited anywhere else in the repository (alert
// rules' runbook_url, the dashboard, help texts, comments): moving or
// renaming a section must move its links with it.
func TestDocLinksReachAHeading(t *testing.T) {
	cache := map[string]map[string]bool{}
	anchors := func(p string) (map[string]bool, bool) {
		if a, ok := cache[p]; ok {
			return a, a != nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			cache[p] = nil
			return nil, false
		}
		cache[p] = anchorsOf(string(src))
		return cache[p], true
	}
	broken := map[string][]string{} // what is cited -> where
	checked := 0
	for _, doc := range docFiles(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, doc)
		for _, m := range anchorLink.FindAllStringSubmatch(string(src), -1) {
			target, anchor := m[1], m[2]
			if strings.Contains(target, "://") || (target != "" && !strings.HasSuffix(target, ".md")) {
				continue
			}
			page := doc
			if target != "" {
				page = filepath.Join(filepath.Dir(doc), target)
			}
			checked++
			a, ok := anchors(page)
			if !ok {
				continue // a missing page is TestDocsCiteWhatExists's to report
			}
			if !a[anchor] {
				broken[target+"#"+anchor] = append(broken[target+"#"+anchor], rel)
			}
		}
	}
	for _, f := range repoFiles(t) {
		if strings.HasSuffix(f, ".md") && (f == "README.md" || strings.HasPrefix(f, "docs/")) {
			continue // checked above, links relative to the page
		}
		if strings.HasPrefix(f, "proof/docscheck/") {
			continue // its examples of citations are not citations
		}
		src, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			continue // listed by git but absent from the work tree
		}
		text := string(src)
		for _, m := range docsAnchor.FindAllStringSubmatch(text, -1) {
			checked++
			a, ok := anchors(filepath.Join(root, "docs", m[2]))
			if !ok || !a[m[3]] {
				k := "docs/" + m[2] + "#" + m[3]
				broken[k] = append(broken[k], f)
			}
		}
		// A heading cited in prose may run over a line break in a comment.
		flat := regexp.MustCompile(`\n\s*(?://|--|#)?\s*`).ReplaceAllString(text, " ")
		for _, m := range docsSection.FindAllStringSubmatch(flat, -1) {
			checked++
			a, ok := anchors(filepath.Join(root, "docs", m[1]))
			if !ok || !citesHeading(a, slug(m[2])) {
				k := fmt.Sprintf("docs/%s, %q", m[1], m[2])
				broken[k] = append(broken[k], f)
			}
		}
	}
	if checked < 100 {
		t.Fatalf("checked %d anchors; expected far more, the patterns are broken", checked)
	}
	t.Logf("checked %d links and citations of a section", checked)
	var keys []string
	for k := range broken {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		t.Errorf("%s cited in %s: no such heading on that page", k, strings.Join(uniq(broken[k]), ", "))
	}
}

// citesHeading: a citation may shorten a heading ("The watermark" for
// "The watermark (G17)"), never name one that is not there.
func citesHeading(anchors map[string]bool, cited string) bool {
	for a := range anchors {
		if a == cited || strings.HasPrefix(a, cited+"-") {
			return true
		}
	}
	return false
}

// repoFiles lists the repository's tracked files.
func repoFiles(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("git", "-C", root, "ls-files").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	files := strings.Fields(string(out))
	if len(files) < 100 {
		t.Fatalf("git ls-files listed %d files; is it running in the repository?", len(files))
	}
	return files
}

// TestDocsPagesStayShort fails for a README of 200 lines or more and a docs
// page over 500: the README is the newcomer's first screen, and a long page
// is split by topic with docs/README.md as the index.
func TestDocsPagesStayShort(t *testing.T) {
	for _, doc := range docFiles(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, doc)
		lines := strings.Count(string(src), "\n")
		if !strings.HasSuffix(string(src), "\n") {
			lines++
		}
		limit := maxDocsPageLine
		if rel == "README.md" {
			limit = maxReadmeLines
		}
		if lines > limit {
			t.Errorf("%s has %d lines, at most %d: split it by topic (and list the new page in docs/README.md)", rel, lines, limit)
		}
	}
}

// TestDocsIndexListsEveryPage fails for a page of docs/ that docs/README.md,
// the index, does not link to.
func TestDocsIndexListsEveryPage(t *testing.T) {
	index, err := os.ReadFile(filepath.Join(root, "docs", "README.md"))
	if err != nil {
		t.Fatalf("docs/README.md, the index of docs/: %v", err)
	}
	linked := map[string]bool{}
	for _, m := range linkTarget.FindAllStringSubmatch(string(index), -1) {
		linked[filepath.Clean(m[1])] = true
	}
	for _, doc := range docFiles(t) {
		name := filepath.Base(doc)
		if filepath.Dir(doc) != filepath.Join(root, "docs") || name == "README.md" {
			continue
		}
		if !linked[name] {
			t.Errorf("docs/README.md does not list docs/%s: add it with a line on what it is for", name)
		}
	}
}
