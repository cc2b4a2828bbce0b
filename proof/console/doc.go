// Package console holds the console's browser test: the console driven in
// a real headless Chromium through chromedp. It lives in the proof module so
// that chromedp is no requirement of the product module applications
// import.
package console
