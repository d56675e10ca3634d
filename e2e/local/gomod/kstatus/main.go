// kstatus prints kstatus's verdict (sigs.k8s.io/cli-utils/pkg/kstatus/status) for one
// Kubernetes object read as JSON from stdin: {"status": "Current", "message": "..."}.
// Tests use it to check that a PDCluster's conditions read the way Flux and
// `kstatus`-based tools read them.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	// Unstructured's own decoder keeps integers int64, as kstatus reads them.
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(raw); err != nil {
		fail(fmt.Errorf("stdin is not a Kubernetes object: %w", err))
	}
	result, err := status.Compute(obj)
	if err != nil {
		fail(err)
	}
	out, _ := json.Marshal(map[string]string{"status": result.Status.String(), "message": result.Message})
	fmt.Println(string(out))
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus:", err)
	os.Exit(1)
}
