// The device's labelled training samples, as the app holds them (decoded images, sensor windows...).
package org.fedfleet.device;

public interface LocalData {
    int size();

    /** The model input of sample i, e.g. a CHW float image normalised as the bundle's manifest says. */
    float[] input(int i);

    /** The global class id of sample i. */
    int label(int i);
}
